"""Sliding windows and soft-capping in the torch backend: its C decode and prefill
kernels and its plain-torch path against the definition (``tests/window_cases.py``),
on caches where every block wholly before a window is a NaN placeholder."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.cpu_kernel import decode_kernel
from pdserve.engine.attention.cpu_prefill import prefill_kernel
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from tests.window_cases import WINDOWS, dense_attention, first_visible, paged_sequences, resolve

# on each ISA the CPU has (tests/conftest.py isa)
needs_kernels = pytest.mark.usefixtures("isa")
SOFTCAPS = [None, 2.0]
# (query heads, KV heads): GQA 1, 3 and 8, MQA with an odd head count
HEADS = [(2, 2), (9, 3), (16, 2), (5, 1)]


def test_window_semantics_are_hf_transformers():
    """first_visible is HF's causal mask with its sliding-window overlay, position by
    position."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    for window in (1, 2, 5, 8):
        overlay = sliding_window_overlay(window)
        for p in range(20):
            for k in range(20):
                hf = causal_mask_function(0, 0, p, k) and overlay(0, 0, p, k)
                assert hf == (first_visible(p, window) <= k <= p), (window, p, k)


def _decode_case(lens, window, block_size, heads, head_dim, seed=0):
    hq, hkv = heads
    specs = [(n, first_visible(n - 1, window)) for n in lens]
    k_cache, v_cache, tables, keys, values = paged_sequences(specs, block_size, hkv, head_dim)
    q = torch.randn(len(lens), hq, head_dim, generator=torch.Generator().manual_seed(seed))
    return q, k_cache, v_cache, tables, keys, values


def _decode_reference(q, keys, values, lens, scale, window, softcap):
    return torch.cat(
        [
            dense_attention(q[i : i + 1], keys[i], values[i], [n - 1], scale, window, softcap)
            for i, n in enumerate(lens)
        ]
    ).float()


@needs_kernels
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (48, 7)])
def test_c_decode_matches_the_definition(head_dim, block_size, heads, window, softcap):
    lens = [1, 5, 16, 21, 40, 64, 300]
    window = resolve(window, max(lens))
    q, k_cache, v_cache, tables, keys, values = _decode_case(
        lens, window, block_size, heads, head_dim
    )
    scale = head_dim**-0.5
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = decode_kernel()(q, k_cache, v_cache, tables, lens_t, scale, window, softcap)
    ref = _decode_reference(q, keys, values, lens, scale, window, softcap)
    torch.testing.assert_close(out, ref)


def _chunk_case(chunks, window, block_size, heads, head_dim, seed=0):
    """One sequence per (earlier context, chunk length), the chunk at its end."""
    hq, hkv = heads
    specs = [(ctx + n, first_visible(ctx, window)) for ctx, n in chunks]
    k_cache, v_cache, tables, keys, values = paged_sequences(specs, block_size, hkv, head_dim)
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(n, hq, head_dim, generator=g) for _, n in chunks]
    return qs, k_cache, v_cache, tables, keys, values


# (earlier context, chunk): whole prompts, chunks part-way through a sequence, a chunk
# of one token (a decode), chunks crossing the C kernel's tiles of 96 query rows and
# 64 keys
CHUNKS = [(0, 1), (0, 37), (3, 1), (40, 7), (17, 130), (200, 1), (150, 65)]


@needs_kernels
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (18, 7)])
def test_c_prefill_matches_the_definition(head_dim, block_size, heads, window, softcap):
    window = resolve(window, max(ctx + n for ctx, n in CHUNKS))
    qs, k_cache, v_cache, tables, keys, values = _chunk_case(
        CHUNKS, window, block_size, heads, head_dim
    )
    scale = head_dim**-0.5
    for i, (ctx, n) in enumerate(CHUNKS):
        out = torch.full_like(qs[i], float("nan"))
        prefill_kernel()(qs[i], k_cache, v_cache, tables[i], ctx + n, scale, out, window, softcap)
        positions = range(ctx, ctx + n)
        ref = dense_attention(qs[i], keys[i], values[i], positions, scale, window, softcap)
        torch.testing.assert_close(out, ref.float(), msg=lambda m, c=(ctx, n): f"{c}: {m}")


def _mixed_step(chunks, decode_lens, window, block_size, heads, head_dim):
    """A batch of prefill chunks then decodes over paged caches (the new tokens' K/V
    among the cached ones, passed again as k, v as the model would)."""
    all_chunks = chunks + [(n - 1, 1) for n in decode_lens]
    qs, k_cache, v_cache, tables, keys, values = _chunk_case(
        all_chunks, window, block_size, heads, head_dim
    )
    bs = block_size
    slots, ks, vs = [], [], []
    for i, (ctx, n) in enumerate(all_chunks):
        for p in range(ctx, ctx + n):
            slots.append(int(tables[i, p // bs]) * bs + p % bs)
        ks.append(keys[i][ctx:])
        vs.append(values[i][ctx:])
    query_lens = [n for _, n in all_chunks]
    seq_lens = [ctx + n for ctx, n in all_chunks]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots),
        num_decodes=len(decode_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    qkv = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    return qkv, k_cache, v_cache, meta, keys, values, all_chunks


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", [1, 6, 16, 23, 1000, None])
@pytest.mark.parametrize("heads", [(9, 3), (4, 1)])
def test_backend_mixed_step_matches_the_definition(heads, window, softcap, use_kernel):
    """Prefills (whole, part-way, one token) and decodes in one step, through the C
    kernels or the plain-torch path. The plain-torch path reads whole blocks from the
    one holding a window's first position, so only the blocks wholly before it hold NaN."""
    (q, k, v), k_cache, v_cache, meta, keys, values, chunks = _mixed_step(
        [(0, 30), (25, 9), (40, 1)], [1, 17, 45], window, 8, heads, 32
    )
    if not use_kernel:
        k_cache[1:], v_cache[1:] = k_cache[1:].nan_to_num(), v_cache[1:].nan_to_num()
    backend = TorchAttentionBackend(use_kernel=use_kernel)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.2, window=window, softcap=softcap)
    rows = meta.query_start_loc.tolist()
    ref = []
    for i, (ctx, n) in enumerate(chunks):
        qi = q[rows[i] : rows[i + 1]]
        ref.append(
            dense_attention(qi, keys[i], values[i], range(ctx, ctx + n), 0.2, window, softcap)
        )
    torch.testing.assert_close(out, torch.cat(ref).float())


@pytest.mark.parametrize("window, softcap", [(0, None), (-2, None), (2.5, None), (None, 0.0)])
def test_backend_refuses_bad_windows(window, softcap):
    (q, k, v), k_cache, v_cache, meta, *_ = _mixed_step([(0, 3)], [4], None, 8, (2, 2), 16)
    name = "window" if softcap is None else "softcap"
    with pytest.raises(ValueError, match=name):
        TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.2, window, softcap)
