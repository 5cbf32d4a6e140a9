"""GLA and GTA (arXiv 2505.21487) as configurations of the engine's latent attention,
against the torch reference written from the paper's definitions (tests/latent_reference.py):
logits over a prompt and decode steps, greedy outputs over chunk sizes (mixed steps),
tensor parallelism (GLA's latent heads and GTA's tied states split across ranks), and
the absorbed decode against the expanded form."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.latent_torch import paged_latent_decode
from tests.engine_utils import prompt_logits, stepwise_logits
from tests.latent_reference import (
    reference_greedy,
    reference_logits,
    save_tiny_gla,
    save_tiny_gta,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SAVERS = {
    "gla2": lambda folder: save_tiny_gla(folder, latent_heads=2),
    "gla4": lambda folder: save_tiny_gla(folder, latent_heads=4),
    "gta2": lambda folder: save_tiny_gta(folder, groups=2),
}


def _prompts(lengths=(5, 17, 30), seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (path, prompts, the reference's greedy continuation of each)."""
    made = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{name}")
            SAVERS[name](folder)
            prompts = _prompts()
            greedy = [reference_greedy(str(folder), p, GREEDY.max_tokens) for p in prompts]
            made[name] = str(folder), prompts, greedy
        return made[name]

    return get


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SAVERS))
def test_logits_equal_the_reference_over_prompt_and_decode_steps(tiny, name):
    path, prompts, greedy = tiny(name)
    llm = LLM(path, max_batch_tokens=64, num_kv_blocks=64)
    for ids, more in zip(prompts, greedy, strict=True):
        full = ids + more[:6]
        expected = reference_logits(path, full)
        torch.testing.assert_close(
            prompt_logits(llm.engine, ids), expected[: len(ids)], atol=1e-4, rtol=1e-4
        )
        got = stepwise_logits(llm.engine, full, len(ids))
        torch.testing.assert_close(got, expected[len(ids) - 1 :], atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["gla2", "gta2"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_greedy_equals_the_reference_at_every_chunk_size(tiny, name, chunk):
    path, prompts, expected = tiny(name)
    llm = LLM(path, max_batch_tokens=chunk, num_kv_blocks=64)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    llm.engine.blocks.check_integrity()
    assert llm.engine.blocks.num_free_blocks == 64


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "degree"), [("gla4", 2), ("gla4", 4), ("gla2", 2), ("gta2", 2)])
def test_tensor_parallel_splits_the_latent_heads(tiny, name, degree):
    """Each rank caches only its latent/tied heads (and the RoPE key)."""
    path, prompts, expected = tiny(name)
    heads = {"gla4": 4, "gla2": 2, "gta2": 2}[name]
    width = 16 * heads // degree + 8
    with LLM(path, max_batch_tokens=16, num_kv_blocks=64, tensor_parallel=degree) as llm:
        assert llm.engine.runner.kv_cache.shape == (2, 64, 16, width)
        assert llm.engine.runner.kv_bytes_per_token == 2 * width * 4
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(SAVERS))
def test_absorbed_decode_equals_expanded_on_the_same_cache(tiny, name):
    attention = LLM(tiny(name)[0], num_kv_blocks=8).engine.model.layers[0].mla
    g = torch.Generator().manual_seed(1)
    lens = [1, 4, 5, 13]
    cache = torch.randn(12, 4, attention.cache_width, generator=g)
    tables = torch.randperm(12, generator=g).view(3, 4)
    tables = torch.cat([tables, tables[:1].flip(1)]).to(torch.int32)
    h = attention.num_heads
    q_nope = torch.randn(len(lens), h, attention.dn, generator=g)
    q_r = torch.randn(len(lens), h, attention.dr, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    absorbed = attention.absorbed(q_nope, q_r, cache, tables, seq_lens, paged_latent_decode)
    for b, n in enumerate(lens):
        expanded = attention.expanded(q_nope[b : b + 1], q_r[b : b + 1], cache, tables[b], n)
        torch.testing.assert_close(absorbed[b : b + 1], expanded, atol=1e-5, rtol=1e-5)
