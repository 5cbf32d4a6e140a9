"""The Triton backend on a mixed step (prefill chunks, then decodes) against references."""

import pytest
import torch
from paged_cases import DEVICE, DTYPES, TOLERANCES, dtype_id, int32, layout_id, paged_kv

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.attention.triton_backend import TritonAttentionBackend
from pdserve.kernels.kv_cache_write import ref_write_kv_cache
from pdserve.kernels.paged_prefill_attention import ref_paged_prefill_attention


def _mixed_step(chunks, num_decodes, block_size, heads, head_dim, dtype):
    """Caches, new q/k/v and metadata for sequences given as (cached context, new tokens),
    the last ``num_decodes`` of them decodes."""
    hq, hkv = heads
    seq_lens = [ctx + n for ctx, n in chunks]
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, hkv, head_dim, dtype)
    starts, slots = [0], []
    for i, (ctx, n) in enumerate(chunks):
        starts.append(starts[-1] + n)
        for pos in range(ctx, ctx + n):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    t = starts[-1]
    q = torch.randn(t, hq, head_dim, dtype=dtype, device=DEVICE)
    kv = torch.randn(t, 2, hkv, head_dim, dtype=dtype, device=DEVICE)
    query_lens = [n for _, n in chunks]
    meta = AttentionMetadata(
        query_start_loc=int32(starts),
        seq_lens=int32(seq_lens),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    return q, kv[:, 0], kv[:, 1], k_cache, v_cache, meta


# Three prefill chunks (a whole prompt, a chunk after a full block, a late chunk),
# then decodes at lengths 1, bs, bs + 1 and 300.
CHUNKS = [(0, 5), (16, 17), (250, 47), (0, 1), (15, 1), (16, 1), (299, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=layout_id)
def test_mixed_step_matches_references(heads, dtype):
    q, k, v, k_cache, v_cache, meta = _mixed_step(CHUNKS, 4, 16, heads, 64, dtype)
    assert (meta.num_prefills, meta.num_decodes) == (3, 4)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)

    ref_write_kv_cache(k, v, ref_k, ref_v, meta.slot_mapping)
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)
    ref = ref_paged_prefill_attention(
        q, ref_k, ref_v, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125
    )
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])

    # The torch backend reads whole blocks, so it gets the caches without NaN.
    k0, v0 = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    torch_out = TorchAttentionBackend().forward(q, k, v, k0, v0, meta, 0.125)
    torch.testing.assert_close(out, torch_out, **TOLERANCES[dtype])
