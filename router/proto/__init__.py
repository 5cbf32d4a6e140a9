"""The router's protobuf messages and gRPC stubs, generated from ``pdserve.proto`` at
first import (engine/protostubs.py); ``python -m router.proto`` forces it (setup.sh)."""

from __future__ import annotations

from pathlib import Path

from engine.protostubs import generate as _generate

PROTO = Path(__file__).resolve().parent / "pdserve.proto"


def generate(force: bool = False) -> None:
    _generate(PROTO, force)


generate()

from router.proto import pdserve_pb2, pdserve_pb2_grpc  # noqa: E402

__all__ = ["generate", "pdserve_pb2", "pdserve_pb2_grpc"]
