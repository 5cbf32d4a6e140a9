"""Writing new K/V rows into the paged cache through a slot mapping.

Cache layout (one layer): ``k_cache``, ``v_cache`` each
[num_blocks, block_size, num_kv_heads, head_dim] (token-major blocks); slot ``s`` is
offset ``s % block_size`` of block ``s // block_size``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import check_index, check_like


@triton.jit
def _kv_cache_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + blk * stride_kcb + h * stride_kch + off * stride_kct + d, k, mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + h * stride_vch + off * stride_vct + d, v, mask=mask)


def _check(k, v, k_cache, v_cache, slot_mapping):
    if k.dim() != 3:
        raise ValueError(f"k: expected [T, num_kv_heads, head_dim], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} like k, got {tuple(v.shape)}")
    t, h, d = k.shape
    if k_cache.dim() != 4 or k_cache.shape[2] != h or k_cache.shape[3] != d:
        raise ValueError(
            f"k_cache: expected [num_blocks, block_size, {h}, {d}], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache: expected shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    check_index("slot_mapping", slot_mapping, (t,), torch.int64, k_cache.device)
    check_like("k_cache", k_cache, v_cache=v_cache, k=k, v=v)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes k, v [T, Hkv, D] into the caches at ``slot_mapping`` [T] int64, in place."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    t, h, d = k.shape
    if t == 0:
        return
    _kv_cache_write_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_KV_HEADS=h,
        HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(h),
        BLOCK_D=triton.next_power_of_2(d),
        PAGE_SIZE=k_cache.shape[1],
    )


def ref_write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    bs = k_cache.shape[1]
    k_cache[slot_mapping // bs, slot_mapping % bs] = k
    v_cache[slot_mapping // bs, slot_mapping % bs] = v


def ref_gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached K and V of one sequence, each [Hkv, seq_len, D]."""
    blocks = block_table[: -(-seq_len // k_cache.shape[1])].long()

    def gather(cache):
        return cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)

    return gather(k_cache), gather(v_cache)
