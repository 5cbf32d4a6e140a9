"""The C prefill-attention kernel of the torch backend (``cpu_prefill.c``), built on
first use by ``engine/native.py``; ``prefill_kernel()`` is None where it cannot be built."""

from __future__ import annotations

import ctypes

import torch

from pdserve.engine import native
from pdserve.engine.attention.backend import check_window
from pdserve.engine.attention.cpu_kernel import float32_cpu_caches

_P, _I = ctypes.c_void_p, ctypes.c_int64


class PrefillKernel:
    """``paged_prefill_f32`` from a loaded library: one sequence's chunk of queries
    against its cached K/V (the chunk's own included), causally, optionally within a
    sliding window and with soft-capped scores."""

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.paged_prefill_f32
        fn.argtypes = [_P, _I, _P, _P, _P, _I, _I, _P] + [_I] * 5 + [ctypes.c_float]
        fn.argtypes += [_I, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return float32_cpu_caches(q, k_cache, v_cache)

    def __call__(
        self,
        q,
        k_cache,
        v_cache,
        block_table,
        context: int,
        scale: float,
        out,
        window=None,
        softcap=None,
    ):
        """q [T, Hq, D] (heads packed in a row) at positions context - T .. context - 1;
        block_table [>= ceil(context / block_size)] int32. Writes out [T, Hq, D]. With a
        ``window`` W the token at position p reads positions max(0, p - W + 1) .. p only;
        ``softcap`` caps the scores (``AttentionBackend``'s contract)."""
        check_window(window, softcap)
        t, hq, d = q.shape
        _, block_size, hkv, dk = k_cache.shape
        if k_cache.shape != v_cache.shape or dk != d or hq % hkv:
            raise ValueError(
                f"prefill: q {tuple(q.shape)} does not fit the caches {tuple(k_cache.shape)} "
                f"and {tuple(v_cache.shape)} (head dim equal, query heads a multiple of KV heads)"
            )
        if not 0 < t <= context or block_table.numel() * block_size < context:
            raise ValueError(
                f"prefill: {t} tokens, context {context}, {block_table.numel()} blocks of "
                f"{block_size}: need 0 < tokens <= context <= blocks * block size"
            )
        if block_table.dtype != torch.int32:
            raise ValueError(f"prefill: the block table must be int32, not {block_table.dtype}")
        for name, x in (("q", q), ("out", out)):
            if x.stride(2) != 1 or x.stride(1) != d:
                raise ValueError(f"prefill: {name} needs its heads packed in each row")
        if out.shape != q.shape:
            raise ValueError(f"prefill: out {tuple(out.shape)} must match q {tuple(q.shape)}")
        table = block_table.contiguous()
        # paged_prefill_f32's arguments in its order, grouped by what they describe
        query = (q.data_ptr(), q.stride(0))
        cache = (k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr())
        output = (out.data_ptr(), out.stride(0))
        shape = (hq, hkv, d, block_size)
        knobs = (scale, window or 0, softcap or 0.0, torch.get_num_threads())
        rc = self.fn(*query, *cache, t, context, *output, *shape, *knobs)
        if rc != 0:
            raise MemoryError("paged_prefill_f32: could not allocate its scratch")
        return out


# the kernel of the ISA in use (engine/native.py), or None when it cannot be built or loaded
prefill_kernel = native.per_isa(PrefillKernel)
