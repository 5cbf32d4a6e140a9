"""The C latent decode kernel (``cpu_latent.c``: MLA, GLA and GTA in absorbed form),
built on first use by ``engine/native.py``.

``paged_latent_decode`` has the signature and semantics of
``kernels.paged_latent_decode`` (see that module and cpu_latent.c): q_c [B, H, Dk],
q_r [B, H, Dr], the strided views c_cache [N, bs, Hc, Dc] and r_cache [N, bs, Dr] of one
latent cache allocation, block_tables [B, M] and seq_lens [B] int32 -> out [B, H, Dc].
It returns None where the C library cannot be built or the inputs are not float32 CPU
tensors with Dk, Dc and Dr multiples of 16: the caller then runs its torch path.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.engine import native

_P, _I = ctypes.c_void_p, ctypes.c_int64


class LatentDecodeKernel:
    """``paged_latent_decode_f32`` from a loaded library."""

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.paged_latent_decode_f32
        fn.argtypes = [_P, _P, _P, _I, _I, _I, _P, _I, _I, _P, _I, _P, _P]
        fn.argtypes += [_I] * 7 + [ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn

    @staticmethod
    def supports(q_c, q_r, c_cache, r_cache) -> bool:
        """float32 CPU tensors, caches with a contiguous last dimension, Dk, Dc and Dr
        multiples of the kernel's 16 lanes."""
        tensors = (q_c, q_r, c_cache, r_cache)
        return (
            all(x.device.type == "cpu" and x.dtype == torch.float32 for x in tensors)
            and c_cache.stride(-1) == 1
            and r_cache.stride(-1) == 1
            and q_c.shape[-1] % 16 == 0
            and c_cache.shape[-1] % 16 == 0
            and r_cache.shape[-1] % 16 == 0
        )

    def __call__(self, q_c, q_r, c_cache, r_cache, block_tables, seq_lens, scale: float):
        _check(q_c, q_r, c_cache, r_cache, block_tables, seq_lens)
        b, h, dk = q_c.shape
        _, block_size, hc, dc = c_cache.shape
        dr = r_cache.shape[-1]
        out = torch.empty(b, h, dc)
        if b == 0:
            return out
        q_c, q_r, seq_lens = q_c.contiguous(), q_r.contiguous(), seq_lens.contiguous()
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        # paged_latent_decode_f32's arguments in its order, grouped by what they describe
        queries = (q_c.data_ptr(), q_r.data_ptr())
        latent = (c_cache.data_ptr(), *c_cache.stride()[:3])
        rope = (r_cache.data_ptr(), *r_cache.stride()[:2])
        tables = (block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr())
        shape = (b, h, hc, dk, dc, dr, block_size)
        threads = torch.get_num_threads()
        rc = self.fn(*queries, *latent, *rope, *tables, out.data_ptr(), *shape, scale, threads)
        if rc != 0:
            raise MemoryError("paged_latent_decode_f32: could not allocate its buffers")
        return out


def _check(q_c, q_r, c_cache, r_cache, block_tables, seq_lens) -> None:
    """The C kernel trusts these shapes (a mismatch reads outside the buffers)."""
    if q_c.dim() != 3 or q_r.dim() != 3 or q_c.shape[:2] != q_r.shape[:2]:
        raise ValueError(
            f"latent decode: q_c {tuple(q_c.shape)} and q_r {tuple(q_r.shape)} must be "
            "[B, H, Dk] and [B, H, Dr]"
        )
    b, h, dk = q_c.shape
    if c_cache.dim() != 4 or h % c_cache.shape[2] or not 0 < dk <= c_cache.shape[3]:
        raise ValueError(
            f"latent decode: c_cache {tuple(c_cache.shape)} must be [N, block_size, Hc, Dc] "
            f"with Hc dividing {h} query heads and Dc >= Dk = {dk}"
        )
    if r_cache.shape != (*c_cache.shape[:2], q_r.shape[2]):
        raise ValueError(
            f"latent decode: r_cache {tuple(r_cache.shape)} must be "
            f"[{c_cache.shape[0]}, {c_cache.shape[1]}, {q_r.shape[2]}] (c_cache's blocks, "
            "q_r's Dr)"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"latent decode: block tables and lengths must be int32, not "
            f"{block_tables.dtype} and {seq_lens.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(
            f"latent decode: {b} sequences but block tables {tuple(block_tables.shape)} and "
            f"lengths {tuple(seq_lens.shape)}"
        )


# the kernel of the ISA in use (engine/native.py), or None when it cannot be built or loaded
latent_decode_kernel = native.per_isa(LatentDecodeKernel)


def paged_latent_decode(q_c, q_r, c_cache, r_cache, block_tables, seq_lens, scale: float):
    """out [B, H, Dc] from the C kernel, or None where it is unavailable or does not
    support these inputs (see the module docstring); raises ValueError on shapes that do
    not fit the latent decode contract."""
    kernel = latent_decode_kernel()
    if kernel is None or not kernel.supports(q_c, q_r, c_cache, r_cache):
        return None
    return kernel(q_c, q_r, c_cache, r_cache, block_tables, seq_lens, scale)
