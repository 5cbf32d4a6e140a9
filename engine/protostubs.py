"""Protobuf and gRPC stubs generated next to their ``.proto`` (build outputs, ignored by git).

The serving packages call ``generate`` when first imported: it writes the stubs when
they are missing or older than the ``.proto``. Several processes may import at once
(Ray workers, the router, tests): each writes into a private temporary folder and
moves the files into place.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path


def generate(proto: Path, force: bool = False) -> None:
    """Write ``<name>_pb2.py``, ``.pyi`` and ``_pb2_grpc.py`` beside ``proto`` if stale.

    ``proto`` lives in a package folder directly under the import root, so the
    generated imports read ``from <package>.<folder> import ...``.
    """
    here, root = proto.parent, proto.parent.parent.parent
    outputs = [f"{proto.stem}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    mtime = proto.stat().st_mtime
    stale = any(not (here / n).exists() or (here / n).stat().st_mtime < mtime for n in outputs)
    if not (force or stale):
        return
    from grpc_tools import protoc

    include = Path(protoc.__file__).resolve().parent / "_proto"
    rel = proto.relative_to(root)
    with tempfile.TemporaryDirectory(prefix=".protoc-", dir=here) as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(rel),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {proto}")
        for name in outputs:
            os.replace(Path(tmp) / rel.parent / name, here / name)
    importlib.invalidate_caches()
