"""The KV transfer protobuf messages and gRPC stubs, generated from ``kv_transfer.proto``.

The stubs are build outputs (ignored by git): the first import generates them with
``grpc_tools.protoc`` next to the ``.proto``, and again whenever the ``.proto`` is
newer than them. ``python -m kv_transfer.proto`` generates them ahead of time (for a
read-only install). Several processes may import this at once (Ray workers, tests, the
benchmark): each writes into a private temporary folder and moves the files into place.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent.parent  # the folder holding the ``kv_transfer`` package
_PROTO = _HERE / "kv_transfer.proto"
_OUTPUTS = ("kv_transfer_pb2.py", "kv_transfer_pb2.pyi", "kv_transfer_pb2_grpc.py")


def _stale() -> bool:
    mtime = _PROTO.stat().st_mtime
    return any(
        not (_HERE / name).exists() or (_HERE / name).stat().st_mtime < mtime for name in _OUTPUTS
    )


def generate(force: bool = False) -> None:
    """Write the stubs next to the ``.proto`` when missing or older than it."""
    if not force and not _stale():
        return
    from grpc_tools import protoc

    include = Path(protoc.__file__).resolve().parent / "_proto"
    rel = _PROTO.relative_to(_ROOT)
    with tempfile.TemporaryDirectory(prefix=".protoc-", dir=_HERE) as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(rel),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {_PROTO}")
        for name in _OUTPUTS:
            os.replace(Path(tmp) / rel.parent / name, _HERE / name)
    importlib.invalidate_caches()


generate()

# The gRPC stubs (kv_transfer_pb2_grpc, for other clients) are not imported here: the
# backend registers its handler generically, and generated stubs refuse a grpcio older
# than the grpcio-tools that wrote them.
from kv_transfer.proto import kv_transfer_pb2  # noqa: E402

__all__ = ["generate", "kv_transfer_pb2"]
