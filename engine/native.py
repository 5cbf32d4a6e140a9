"""C sources of the engine's CPU kernels, built on first use and loaded with ctypes.

A source is compiled with the system C compiler (``$CC``, else ``cc``) into a shared
library under ``$PDSERVE_KERNEL_CACHE`` (default ``~/.cache/pdserve/kernels``), named by
a hash of the source, the flags and the CPU: a fraction of a second once per machine,
no torch headers. Its OpenMP is the libgomp torch has already loaded, so it shares
torch's thread pool instead of competing with it.

When there is no compiler or the build fails, ``load()`` returns None (with one
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


def build(source: Path, cache: Path | None = None) -> Path:
    """The compiled library for ``source`` (built now unless cached); raises on failure."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"no C compiler: {cc!r} is not on PATH")
    key = hashlib.sha256(
        source.read_bytes() + " ".join([cc, *FLAGS, platform.machine(), _cpu_id()]).encode()
    ).hexdigest()[:16]
    cache = cache or _cache_dir()
    target = cache / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent builders never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *FLAGS, str(source), "-o", tmp, "-lm"],
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
def load(source: Path) -> ctypes.CDLL | None:
    """The loaded library of ``source``, or None (warned once) when it cannot be built."""
    try:
        return ctypes.CDLL(str(build(source)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("C kernels of %s unavailable, using plain torch: %s %s", source.name, e, detail)
        return None
