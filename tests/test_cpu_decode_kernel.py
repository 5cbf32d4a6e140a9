"""The C decode attention of the torch backend against its plain-torch decode, and the
fallback to plain torch when the kernel cannot be built."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams, native
from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.cpu_kernel import decode_kernel
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.native import build
from tests.engine_utils import hf_greedy

# on each ISA the CPU has (tests/conftest.py isa)
needs_kernel = pytest.mark.usefixtures("isa")


def _decode_step(seq_lens, block_size, heads, head_dim):
    """A decode step: caches with every sequence's blocks shuffled, NaN in every slot
    no sequence owns (a kernel that reads one fails), q/k/v of the new tokens."""
    hq, hkv = heads
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    shape = (num_blocks, block_size, hkv, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32)
    slots = []
    for i, n in enumerate(seq_lens):
        ids = [free.pop() for _ in range(per_seq[i])]
        tables[i, : len(ids)] = torch.tensor(ids)
        for cache in (k_cache, v_cache):
            for pos in range(n - 1):
                cache[ids[pos // block_size], pos % block_size] = torch.randn(hkv, head_dim)
        slots.append(ids[(n - 1) // block_size] * block_size + (n - 1) % block_size)
    b = len(seq_lens)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=b,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_host=[1] * b,
        seq_lens_host=list(seq_lens),
    )
    q, k, v = (
        torch.randn(b, hq, head_dim),
        torch.randn(b, hkv, head_dim),
        torch.randn(b, hkv, head_dim),
    )
    return q, k, v, k_cache, v_cache, meta


def _dense_reference(q, k_cache, v_cache, meta, scale):
    out = []
    for i, n in enumerate(meta.seq_lens_host):
        table = meta.block_tables[i, : -(-n // k_cache.shape[1])].long()
        keys = k_cache[table].flatten(0, 1)[:n]  # [n, Hkv, D]
        values = v_cache[table].flatten(0, 1)[:n]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[i], keys) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", probs, values))
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize("heads", [(2, 2), (9, 3), (16, 2), (5, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_references(block_size, head_dim, heads):
    lens = [1, block_size - 1, block_size, block_size + 1, 300]
    q, k, v, k_cache, v_cache, meta = _decode_step(lens, block_size, heads, head_dim)
    scale = head_dim**-0.5
    fallback_k, fallback_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, _dense_reference(q, k_cache, v_cache, meta, scale))
    # the plain-torch decode reads whole blocks: it gets the caches without NaN
    plain = TorchAttentionBackend(use_kernel=False)
    ref = plain.forward(q, k, v, fallback_k, fallback_v, meta, scale)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_kernel_uses_the_given_thread_count():
    q, k, v, k_cache, v_cache, meta = _decode_step([40] * 7, 16, (9, 3), 64)
    backend = TorchAttentionBackend()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(backend.forward(q, k, v, k_cache, v_cache, meta, 0.125), one)


def test_build_without_a_compiler_raises(isa, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(FileNotFoundError):
        build(isa, cache=tmp_path)


def test_build_is_cached_by_source(isa, tmp_path):
    first = build(isa, cache=tmp_path)
    assert build(isa, cache=tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    assert isa in first.name


@pytest.mark.parametrize("use_kernel", [True, False])
def test_engine_decodes_like_hf_either_way(isa, tiny_model, use_kernel):
    """The C kernels (attention and ops) and their plain-torch fallbacks, end to end."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("gqa3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, max_batch_tokens=64, num_kv_blocks=64)
    llm.engine.model.attn.use_kernel = llm.engine.model.ops.use_kernel = use_kernel
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 20, 33)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, ids, 40)


def test_load_without_a_compiler_is_none(isa, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native._load.__wrapped__(isa) is None


@needs_kernel
@pytest.mark.parametrize(
    "bad, message",
    [
        ({"v_cache": torch.zeros(4, 16, 2, 32)}, "the same"),
        ({"q": torch.zeros(2, 3, 64)}, "does not fit the cache"),
        ({"block_tables": torch.zeros(2, 4, dtype=torch.int64)}, "must be int32"),
        ({"seq_lens": torch.ones(3, dtype=torch.int32)}, "2 sequences"),
    ],
)
def test_kernel_refuses_shapes_it_would_read_past(bad, message):
    args = {
        "q": torch.zeros(2, 4, 64),
        "k_cache": torch.zeros(4, 16, 2, 64),
        "v_cache": torch.zeros(4, 16, 2, 64),
        "block_tables": torch.zeros(2, 4, dtype=torch.int32),
        "seq_lens": torch.ones(2, dtype=torch.int32),
    }
    with pytest.raises(ValueError, match=message):
        decode_kernel()(**{**args, **bad}, scale=0.125)
