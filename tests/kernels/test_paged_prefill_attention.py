import pytest
import torch
from paged_cases import (
    DEVICE,
    DTYPES,
    HEAD_LAYOUTS,
    TOLERANCES,
    dtype_id,
    int32,
    layout_id,
    nan_like,
    paged_kv,
)

from pdserve.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    ref_paged_prefill_attention,
)


def edge_chunks(block_size):
    """(cached context, chunk length) pairs: total lengths 1, bs - 1, bs, bs + 1 and a
    few hundred, chunks that start and end at block edges, a q_len 1 chunk (a decode)
    and a chunk longer than one query tile."""
    bs = block_size
    return [(0, 1), (0, bs - 1), (bs - 1, 1), (1, bs), (bs, 2 * bs + 3), (250, 47), (0, 70)]


def _run(chunks, block_size, heads, head_dim, dtype):
    hq, hkv = heads
    seq_lens = [ctx + n for ctx, n in chunks]
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, hkv, head_dim, dtype)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, head_dim, dtype=dtype, device=DEVICE)
    qsl, lens = int32(starts), int32(seq_lens)
    scale = head_dim**-0.5
    out = nan_like(q)
    max_q = max(n for _, n in chunks)
    paged_prefill_attention(q, k_cache, v_cache, qsl, lens, block_tables, scale, max_q, out=out)
    ref = ref_paged_prefill_attention(q, k_cache, v_cache, qsl, lens, block_tables, scale)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_edge_chunks(block_size, head_dim, heads, dtype):
    _run(edge_chunks(block_size), block_size, heads, head_dim, dtype)


def test_odd_head_dim_and_whole_prompts():
    _run([(0, 37), (0, 5), (0, 64), (0, 65)], 16, (4, 2), 80, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_long_chunks(dtype):
    _run([(0, 1024), (3000, 512), (100, 7)], 32, (32, 8), 128, dtype)


def test_rejects_bad_arguments():
    k_cache, v_cache, block_tables = paged_kv([5], 16, 2, 64, torch.float32)
    q = torch.randn(5, 4, 64, device=DEVICE)
    qsl, lens = int32([0, 5]), int32([5])
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k_cache, v_cache, qsl.long(), lens, block_tables, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k_cache, v_cache, int32([0, 2, 5]), lens, block_tables, 1.0)
    with pytest.raises(ValueError, match="out"):
        paged_prefill_attention(
            q, k_cache, v_cache, qsl, lens, block_tables, 1.0, out=torch.empty(5, 4, 32)
        )
    with pytest.raises(ValueError, match="q"):
        paged_prefill_attention(q.half(), k_cache, v_cache, qsl, lens, block_tables, 1.0)
