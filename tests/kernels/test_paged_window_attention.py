"""Sliding windows and soft-capping in the Triton paged decode and prefill kernels: each
kernel against its ``ref_*``, each reference against the definition
(``tests/window_cases.py``), on caches where every position before a window, and every
block wholly before it, holds NaN (a kernel that reads there fails)."""

import pytest
import torch
from paged_cases import DEVICE, TOLERANCES, int32, layout_id, nan_like

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.triton_backend import TritonAttentionBackend
from pdserve.kernels.paged_decode_attention import (
    paged_decode_attention,
    ref_paged_decode_attention,
)
from pdserve.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    ref_paged_prefill_attention,
)
from tests.window_cases import WINDOWS, dense_attention, first_visible, paged_sequences, resolve

SOFTCAPS = [None, 2.0]
HEADS = [(6, 2), (5, 1)]
F32 = TOLERANCES[torch.float32]


def _on_device(k_cache, v_cache, tables):
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE)


DECODE_LENS = [1, 5, 16, 21, 40, 64, 300]


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", HEADS, ids=layout_id)
def test_decode_matches_reference_and_definition(heads, window, softcap):
    hq, hkv = heads
    lens, d = DECODE_LENS, 32
    window = resolve(window, max(lens))
    specs = [(n, first_visible(n - 1, window)) for n in lens]
    k_cache, v_cache, tables, keys, values = paged_sequences(specs, 16, hkv, d)
    k_cache, v_cache, tables = _on_device(k_cache, v_cache, tables)
    q = torch.randn(len(lens), hq, d, device=DEVICE)
    seq_lens, scale = int32(lens), d**-0.5
    out = nan_like(q)
    paged_decode_attention(
        q, k_cache, v_cache, seq_lens, tables, scale, max(lens), out=out,
        window=window, softcap=softcap,
    )  # fmt: skip
    ref = ref_paged_decode_attention(
        q, k_cache, v_cache, seq_lens, tables, scale, window=window, softcap=softcap
    )
    torch.testing.assert_close(out, ref, **F32)
    dense = [
        dense_attention(q[i : i + 1], keys[i], values[i], [n - 1], scale, window, softcap)
        for i, n in enumerate(lens)
    ]
    torch.testing.assert_close(ref.cpu(), torch.cat(dense).float())


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [70, 130, 200])
def test_decode_splits_partition_the_window(window, num_splits):
    """Split boundaries inside the window, which starts part-way through a block."""
    lens, d = [1, 69, 70, 71, 150, 333], 32
    specs = [(n, first_visible(n - 1, window)) for n in lens]
    k_cache, v_cache, tables, *_ = paged_sequences(specs, 16, 2, d)
    k_cache, v_cache, tables = _on_device(k_cache, v_cache, tables)
    q = torch.randn(len(lens), 6, d, device=DEVICE)
    seq_lens = int32(lens)
    out = paged_decode_attention(
        q, k_cache, v_cache, seq_lens, tables, 0.2, num_splits=num_splits, window=window
    )
    ref = ref_paged_decode_attention(q, k_cache, v_cache, seq_lens, tables, 0.2, window=window)
    torch.testing.assert_close(out, ref, **F32)


# (earlier context, chunk): whole prompts, chunks part-way through a sequence, a chunk
# of one token (a decode), a chunk longer than a query tile (64 tokens)
CHUNKS = [(0, 1), (0, 37), (3, 1), (40, 7), (17, 130), (200, 1), (150, 20)]


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", HEADS, ids=layout_id)
def test_prefill_matches_reference_and_definition(heads, window, softcap):
    hq, hkv = heads
    d = 32
    window = resolve(window, max(ctx + n for ctx, n in CHUNKS))
    specs = [(ctx + n, first_visible(ctx, window)) for ctx, n in CHUNKS]
    k_cache, v_cache, tables, keys, values = paged_sequences(specs, 16, hkv, d)
    k_cache, v_cache, tables = _on_device(k_cache, v_cache, tables)
    starts = [0]
    for _, n in CHUNKS:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, d, device=DEVICE)
    qsl, seq_lens, scale = int32(starts), int32([ctx + n for ctx, n in CHUNKS]), d**-0.5
    out = nan_like(q)
    max_q = max(n for _, n in CHUNKS)
    paged_prefill_attention(
        q, k_cache, v_cache, qsl, seq_lens, tables, scale, max_q, out=out,
        window=window, softcap=softcap,
    )  # fmt: skip
    ref = ref_paged_prefill_attention(
        q, k_cache, v_cache, qsl, seq_lens, tables, scale, window=window, softcap=softcap
    )
    torch.testing.assert_close(out, ref, **F32)
    dense = [
        dense_attention(q[a:e], keys[i], values[i], range(ctx, ctx + n), scale, window, softcap)
        for i, ((ctx, n), a, e) in enumerate(zip(CHUNKS, starts, starts[1:], strict=False))
    ]
    torch.testing.assert_close(ref.cpu(), torch.cat(dense).float())


@pytest.mark.parametrize("window, softcap", [(0, None), (True, None), (None, -1.0)])
def test_kernels_refuse_bad_windows(window, softcap):
    k_cache, v_cache, tables, *_ = paged_sequences([(5, 0)], 16, 2, 32)
    k_cache, v_cache, tables = _on_device(k_cache, v_cache, tables)
    q = torch.randn(1, 4, 32, device=DEVICE)
    name = "window" if softcap is None else "softcap"
    with pytest.raises(ValueError, match=name):
        paged_decode_attention(
            q, k_cache, v_cache, int32([5]), tables, 1.0, window=window, softcap=softcap
        )
    with pytest.raises(ValueError, match=name):
        paged_prefill_attention(
            q, k_cache, v_cache, int32([0, 1]), int32([5]), tables, 1.0,
            window=window, softcap=softcap,
        )  # fmt: skip


def test_backend_mixed_step_passes_the_window_on():
    """Two prefill chunks then two decodes through the Triton backend, windowed and
    capped, against the definition."""
    chunks, window, softcap, d = [(0, 20), (30, 5), (9, 1), (40, 1)], 8, 2.0, 32
    specs = [(ctx + n, first_visible(ctx, window)) for ctx, n in chunks]
    k_cache, v_cache, tables, keys, values = paged_sequences(specs, 16, 2, d)
    k_cache, v_cache, tables = _on_device(k_cache, v_cache, tables)
    starts, slots = [0], []
    for i, (ctx, n) in enumerate(chunks):
        starts.append(starts[-1] + n)
        slots += [int(tables[i, p // 16]) * 16 + p % 16 for p in range(ctx, ctx + n)]
    new_k = torch.cat([keys[i][ctx:] for i, (ctx, _) in enumerate(chunks)]).to(DEVICE)
    new_v = torch.cat([values[i][ctx:] for i, (ctx, _) in enumerate(chunks)]).to(DEVICE)
    lens = [ctx + n for ctx, n in chunks]
    meta = AttentionMetadata(
        query_start_loc=int32(starts),
        seq_lens=int32(lens),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, device=DEVICE),
        num_decodes=2,
        max_query_len=20,
        max_seq_len=max(lens),
        query_lens_host=[n for _, n in chunks],
        seq_lens_host=lens,
    )
    q = torch.randn(starts[-1], 4, d, device=DEVICE)
    out = TritonAttentionBackend().forward(
        q, new_k, new_v, k_cache, v_cache, meta, 0.2, window=window, softcap=softcap
    )
    dense = [
        dense_attention(q[a:e], keys[i], values[i], range(ctx, ctx + n), 0.2, window, softcap)
        for i, ((ctx, n), a, e) in enumerate(zip(chunks, starts, starts[1:], strict=False))
    ]
    torch.testing.assert_close(out.cpu(), torch.cat(dense).float(), **F32)
