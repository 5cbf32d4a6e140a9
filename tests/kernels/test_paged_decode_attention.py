import pytest
import torch
from paged_cases import (
    DEVICE,
    DTYPES,
    HEAD_LAYOUTS,
    TOLERANCES,
    dtype_id,
    edge_lengths,
    int32,
    layout_id,
    nan_like,
    paged_kv,
)

from pdserve.kernels.paged_decode_attention import (
    paged_decode_attention,
    ref_paged_decode_attention,
)


def _run(seq_lens, block_size, heads, head_dim, dtype, num_splits=None):
    hq, hkv = heads
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, hkv, head_dim, dtype)
    q = torch.randn(len(seq_lens), hq, head_dim, dtype=dtype, device=DEVICE)
    lens = int32(seq_lens)
    scale = head_dim**-0.5
    out = nan_like(q)
    paged_decode_attention(
        q, k_cache, v_cache, lens, block_tables, scale, max(seq_lens), num_splits, out=out
    )
    ref = ref_paged_decode_attention(q, k_cache, v_cache, lens, block_tables, scale)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_edge_lengths(block_size, head_dim, heads, dtype):
    _run(edge_lengths(block_size), block_size, heads, head_dim, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("heads", [(6, 2), (8, 1)], ids=layout_id)
def test_context_splits(heads, num_splits):
    """Split boundaries inside and at the edge of blocks, and one split per 64 tokens."""
    _run([1, 63, 64, 65, 130, 321], 16, heads, 64, torch.float32, num_splits)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_long_context(dtype):
    _run([2047, 4096, 33], 32, (32, 8), 128, dtype)


def test_rejects_bad_arguments():
    k_cache, v_cache, block_tables = paged_kv([5], 16, 2, 64, torch.float32)
    q = torch.randn(1, 4, 64, device=DEVICE)
    lens = int32([5])
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, k_cache, v_cache, lens, block_tables.long(), 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, k_cache, v_cache, lens.long(), block_tables, 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode_attention(torch.randn(1, 3, 64), k_cache, v_cache, lens, block_tables, 1.0)
    with pytest.raises(ValueError, match="v_cache"):
        paged_decode_attention(q, k_cache, v_cache.half(), lens, block_tables, 1.0)
