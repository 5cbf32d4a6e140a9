"""The C decode-attention kernel of the torch backend (``cpu_decode.c``), built on first
use by ``engine/native.py``; ``decode_kernel()`` is None where it cannot be built."""

from __future__ import annotations

import ctypes

import torch

from pdserve.engine import native
from pdserve.engine.attention.backend import check_window


class DecodeKernel:
    """``paged_decode_f32`` from a loaded library."""

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.paged_decode_f32
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]
        fn.argtypes += [ctypes.c_int64, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return float32_cpu_caches(q, k_cache, v_cache) and q.shape[-1] % 16 == 0

    def __call__(
        self, q, k_cache, v_cache, block_tables, seq_lens, scale: float, window=None, softcap=None
    ):
        """q [B, Hq, D] float32 -> [B, Hq, D]; see cpu_decode.c for the layouts. With a
        ``window`` only the last ``window`` cached tokens of each sequence are read;
        ``softcap`` caps the scores (``AttentionBackend``'s contract)."""
        _check(q, k_cache, v_cache, block_tables, seq_lens)
        check_window(window, softcap)
        q = q.contiguous()
        out = torch.empty_like(q)
        b, hq, d = q.shape
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        seq_lens = seq_lens.contiguous()
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
            window or 0,
            softcap or 0.0,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("paged_decode_f32: could not allocate its score buffers")
        return out


def float32_cpu_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """What the C attention kernels read: float32 CPU queries and contiguous caches."""
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def _check(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    """The C kernel trusts these shapes (a mismatch reads outside the buffers)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"decode: q {tuple(q.shape)} must be [B, Hq, D], the caches "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)} the same [N, block, Hkv, D]"
        )
    b, hq, d = q.shape
    if k_cache.shape[3] != d or hq % k_cache.shape[2]:
        raise ValueError(
            f"decode: q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} "
            "(head dim equal, query heads a multiple of KV heads)"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"decode: block tables and lengths must be int32, not "
            f"{block_tables.dtype} and {seq_lens.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(
            f"decode: {b} sequences but block tables {tuple(block_tables.shape)} and "
            f"lengths {tuple(seq_lens.shape)}"
        )


# the kernel of the ISA in use (engine/native.py), or None when it cannot be built or loaded
decode_kernel = native.per_isa(DecodeKernel)
