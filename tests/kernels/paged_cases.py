"""Shared cases of the kernel tests: device, dtypes, tolerances and paged KV caches."""

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
# bfloat16 is wrong in the interpreter: it is checked on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}
# (num_q_heads, num_kv_heads): GQA ratios 1, 3 and 8, and MQA with an odd head count.
HEAD_LAYOUTS = [(2, 2), (6, 2), (16, 2), (5, 1)]


def layout_id(heads):
    return f"{heads[0]}q{heads[1]}kv"


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def edge_lengths(block_size):
    """Context lengths at the block edges plus a few hundred."""
    return [1, block_size - 1, block_size, block_size + 1, 300]


def paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype):
    """Caches holding random K/V for each sequence in shuffled blocks, NaN elsewhere.

    Returns (k_cache, v_cache, block_tables). Slots past each sequence's length,
    unused blocks and block 0 (where the padding entries of the block tables point,
    and where a masked block-id load lands) all hold NaN, so a kernel that uses them
    fails its test.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.long)
    for i, n in enumerate(seq_lens):
        ids = [free.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(ids)] = torch.tensor(ids)
        for cache in (k_cache, v_cache):
            cache[ids] = torch.randn(len(ids), *shape[1:], dtype=dtype)
            cache[ids[-1], n - (len(ids) - 1) * block_size :] = float("nan")
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE, torch.int32)


def nan_like(x):
    return torch.full_like(x, float("nan"))


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)
