"""The C prefill attention of the torch backend against a dense causal softmax in
float64 and against the plain-torch (SDPA) prefill of the backend."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.cpu_prefill import prefill_kernel
from pdserve.engine.attention.torch_backend import TorchAttentionBackend

# every test on each ISA the CPU has (tests/conftest.py isa)
pytestmark = pytest.mark.usefixtures("isa")


def _cache(context, block_size, hkv, head_dim, seed=0):
    """Caches holding one sequence of `context` tokens in shuffled blocks, NaN in every
    slot it does not own (a kernel that reads one fails), and its block table."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // block_size)
    shape = (blocks + 3, block_size, hkv, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    table = torch.randperm(blocks + 3, generator=g)[:blocks].to(torch.int32)
    for cache in (k_cache, v_cache):
        rows = torch.randn(context, hkv, head_dim, generator=g)
        for pos in range(context):
            cache[table[pos // block_size], pos % block_size] = rows[pos]
    return k_cache, v_cache, table


def _reference(q, k_cache, v_cache, table, context, scale):
    keys = k_cache[table.long()].flatten(0, 1)[:context].double()  # [context, Hkv, D]
    values = v_cache[table.long()].flatten(0, 1)[:context].double()
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("thd,nhd->htn", q.double(), keys) * scale
    positions = torch.arange(context - q.shape[0], context).view(1, -1, 1)
    scores = scores.masked_fill(torch.arange(context).view(1, 1, -1) > positions, -torch.inf)
    return torch.einsum("htn,nhd->thd", torch.softmax(scores, -1), values).float()


@pytest.mark.parametrize("heads", [(2, 2), (9, 3), (16, 2), (5, 1), (100, 1)])
@pytest.mark.parametrize("head_dim", [64, 48, 18])
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize(
    "tokens, context", [(1, 1), (5, 5), (16, 16), (97, 97), (33, 130), (1, 300), (130, 200)]
)
def test_kernel_matches_a_dense_causal_softmax(tokens, context, block_size, head_dim, heads):
    # odd lengths, block boundaries, chunks after earlier context, tiles of 64 keys and of
    # 96 query rows crossed, GQA ratios 1 to 100 (a group wider than a tile of rows)
    hq, hkv = heads
    if hq > 16 and tokens * context > 10_000:
        pytest.skip("covered at smaller sizes: keeps the grid fast")
    k_cache, v_cache, table = _cache(context, block_size, hkv, head_dim)
    q = torch.randn(tokens, hq, head_dim)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    prefill_kernel()(q, k_cache, v_cache, table, context, scale, out)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, table, context, scale))


def test_kernel_reads_strided_rows_and_any_thread_count():
    k_cache, v_cache, table = _cache(150, 16, 3, 64)
    qkv = torch.randn(70, (9 + 6) * 64)  # q is a view into a fused projection
    q = qkv[:, : 9 * 64].view(70, 9, 64)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(
                prefill_kernel()(q, k_cache, v_cache, table, 150, 0.125, torch.empty(70, 9, 64))
            )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], _reference(q, k_cache, v_cache, table, 150, 0.125))


def test_backend_prefills_and_decodes_like_plain_torch():
    """A mixed step: a whole prompt, a chunk after earlier context, one decode."""
    block_size, hkv, hq, d = 16, 3, 9, 64
    k_cache, v_cache = torch.zeros(20, block_size, hkv, d), torch.zeros(20, block_size, hkv, d)
    tables = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]).int()
    k_cache[5:8].normal_()  # the chunk's sequence already holds 40 tokens
    v_cache[5:8].normal_()
    k_cache[10:13].normal_()  # the decode's sequence 35
    v_cache[10:13].normal_()
    query_lens, seq_lens = [37, 21, 1], [37, 61, 36]
    slots = [*range(37), *range(5 * 16 + 40, 5 * 16 + 61), 10 * 16 + 35]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 37, 58, 59], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots),
        num_decodes=1,
        max_query_len=37,
        max_seq_len=61,
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    q, k, v = torch.randn(59, hq, d), torch.randn(59, hkv, d), torch.randn(59, hkv, d)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    out = TorchAttentionBackend().forward(q, k, v, *caches[0], meta, 0.125)
    ref = TorchAttentionBackend(use_kernel=False).forward(q, k, v, *caches[1], meta, 0.125)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"v_cache": torch.zeros(4, 16, 2, 32)}, "does not fit"),
        ({"q": torch.zeros(3, 3, 64), "out": torch.zeros(3, 3, 64)}, "does not fit"),
        ({"context": 100}, "blocks of"),
        ({"context": 2}, "need 0 < tokens <= context"),
        ({"block_table": torch.zeros(4, dtype=torch.int64)}, "must be int32"),
        ({"q": torch.zeros(3, 64, 4).transpose(1, 2)}, "heads packed"),
        ({"out": torch.zeros(2, 4, 64)}, "must match q"),
    ],
)
def test_kernel_refuses_shapes_it_would_read_past(bad, message):
    args = {
        "q": torch.zeros(3, 4, 64),
        "k_cache": torch.zeros(4, 16, 2, 64),
        "v_cache": torch.zeros(4, 16, 2, 64),
        "block_table": torch.zeros(4, dtype=torch.int32),
        "context": 40,
        "out": torch.zeros(3, 4, 64),
    }
    with pytest.raises(ValueError, match=message):
        prefill_kernel()(**{**args, **bad}, scale=0.125)
