"""The C decode-attention kernel of the torch backend (``cpu_decode.c``), built on first use.

The source is compiled with the system C compiler (``$CC``, else ``cc``) into a shared
library under ``$PDSERVE_KERNEL_CACHE`` (default ``~/.cache/pdserve/kernels``), named by
a hash of the source, the flags and the CPU, and loaded with ctypes: about a second
once per machine, no torch headers. Its OpenMP is the libgomp torch has already
loaded, so it shares torch's thread pool instead of competing with it.

When there is no compiler or the build fails, ``decode_kernel()`` returns None (with
one warning) and the backend keeps its plain-torch decode.
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

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]


class DecodeKernel:
    """``paged_decode_f32`` from a loaded library."""

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.paged_decode_f32
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return (
            q.device.type == "cpu"
            and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and q.shape[-1] % 16 == 0
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float):
        """q [B, Hq, D] float32 -> [B, Hq, D]; see cpu_decode.c for the layouts."""
        q = q.contiguous()
        out = torch.empty_like(q)
        b, hq, d = q.shape
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        seq_lens = seq_lens.contiguous()
        assert block_tables.dtype == seq_lens.dtype == torch.int32
        rc = self.fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            b,
            hq,
            k_cache.shape[2],
            d,
            k_cache.shape[1],
            block_tables.stride(0),
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("paged_decode_f32: could not allocate its score buffers")
        return out


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", default))


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build(source: Path = SOURCE, cache: Path | None = None) -> Path:
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
def decode_kernel() -> DecodeKernel | None:
    """The built kernel, or None (warned once) when it cannot be built or loaded."""
    try:
        return DecodeKernel(ctypes.CDLL(str(build())))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("C decode attention unavailable, using plain torch: %s %s", e, detail)
        return None
