"""C sources of the engine's CPU kernels, built on first use and loaded with ctypes.

The sources (``SOURCES``, with the headers beside them) are compiled together with the
system C compiler (``$CC``, else ``cc``) into one shared library under
``$PDSERVE_KERNEL_CACHE`` (default ``~/.cache/pdserve/kernels``), named by a hash of the
sources, the headers, the flags and the CPU: a second or two once per machine, no
torch headers. Its OpenMP is the libgomp torch has already loaded, so it shares torch's
thread pool instead of competing with it.

When there is no compiler or the build fails, ``library()`` returns None (with one
warning) and the callers keep their plain-torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads libgomp before any library here needs it)

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-Wno-psabi"]
_HERE = Path(__file__).parent
SOURCES = (
    _HERE / "cpu_ops.c",
    _HERE / "cpu_gemm.c",
    _HERE / "amx_gemm.c",
    _HERE / "attention" / "cpu_decode.c",
    _HERE / "attention" / "cpu_prefill.c",
    _HERE / "attention" / "cpu_latent.c",
    _HERE / "cpu_layer.c",
)
HEADERS = (_HERE / "cpu_vec.h", _HERE / "cpu_kernels.h")


def _cache_dir() -> Path:
    """$PDSERVE_KERNEL_CACHE, else ~/.cache/pdserve/kernels, else (not writable) a
    folder in the temporary directory."""
    if "PDSERVE_KERNEL_CACHE" in os.environ:
        return Path(os.environ["PDSERVE_KERNEL_CACHE"])
    home = Path.home() / ".cache" / "pdserve" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"pdserve-kernels-{os.getuid()}"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build(sources: tuple[Path, ...] = SOURCES, cache: Path | None = None) -> Path:
    """The library compiled from ``sources`` (built now unless cached); raises on failure."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"no C compiler: {cc!r} is not on PATH")
    text = b"".join(p.read_bytes() for p in (*sources, *HEADERS))
    key = hashlib.sha256(
        text + " ".join([cc, *FLAGS, platform.machine(), _cpu_id()]).encode()
    ).hexdigest()[:16]
    cache = cache or _cache_dir()
    target = cache / f"pdserve-cpu-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent builders never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *FLAGS, f"-I{_HERE}", *map(str, sources), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (warned once) when they cannot be built."""
    try:
        return ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("C kernels unavailable, using plain torch: %s %s", e, detail)
        return None
