"""The KV transfer protobuf messages, generated from ``kv_transfer.proto`` at first
import (engine/protostubs.py); ``python -m kv_transfer.proto`` forces it."""

from __future__ import annotations

from pathlib import Path

from engine.protostubs import generate as _generate

PROTO = Path(__file__).resolve().parent / "kv_transfer.proto"


def generate(force: bool = False) -> None:
    _generate(PROTO, force)


generate()

# The gRPC stubs (kv_transfer_pb2_grpc, for other clients) are not imported here: the
# backend registers its handler generically, and generated stubs refuse a grpcio older
# than the grpcio-tools that wrote them.
from kv_transfer.proto import kv_transfer_pb2  # noqa: E402

__all__ = ["generate", "kv_transfer_pb2"]
