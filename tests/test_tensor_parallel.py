"""Tensor parallelism in the engine: ranks 1..N-1 as local processes in a gloo world,
rank 0 scheduling and broadcasting each step. Greedy outputs equal tensor_parallel=1
for chunked prefill, decode and the mixed step."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    """Lengths inside a block, across blocks and over several 16-token chunks."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, 256) for _ in range(rng.choice([1, 5, 16, 17, 40, 70]))] for _ in range(n)
    ]


@pytest.mark.parametrize("degree", [2, 4])
def test_tiny_kv4_equals_one_rank(tiny_model, degree):
    path, prompts = tiny_model("kv4"), _prompts()
    # a 16-token budget: prompts run in chunks, next to the decodes of earlier requests
    want = [o.token_ids for o in LLM(path, max_batch_tokens=16).generate(prompts, PARAMS)]
    with LLM(path, max_batch_tokens=16, tensor_parallel=degree) as llm:
        got = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        assert llm.engine.model.layers[0].num_kv_heads == 4 // degree
        assert llm.engine.runner.kv_cache.shape[-2] == 4 // degree
    assert got == want


def test_several_choices_and_prompt_logprobs_equal_one_rank(tiny_model):
    """``n`` choices fork from the prompt's blocks, the partial one copied on every rank
    (``StepPlan.fork_blocks``); the prompt's logprobs are scored from the rows every
    rank computes."""
    path, prompts = tiny_model("kv4"), _prompts(4, seed=2)
    params = SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=12, ignore_eos=True,
                            prompt_logprobs=2)  # fmt: skip
    want = LLM(path, max_batch_tokens=16).generate(prompts, params)
    with LLM(path, max_batch_tokens=16, tensor_parallel=2) as llm:
        got = llm.generate(prompts, params)
        llm.engine.check_integrity()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert a.top_ids == b.top_ids and a.rank == b.rank
            assert abs(a.logprob - b.logprob) < 1e-4


def test_speculative_decoding_equals_one_rank_without_it(tiny_model):
    """Prompt-lookup drafts verified as rows of the decode step on every rank
    (engine/speculative.py): the plain one-rank engine's greedy output."""
    path, prompts = tiny_model("kv4"), [p * 3 for p in _prompts(6, seed=3)]
    want = [o.token_ids for o in LLM(path, max_batch_tokens=16).generate(prompts, PARAMS)]
    with LLM(path, max_batch_tokens=16, tensor_parallel=2, speculative_tokens=3) as llm:
        assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == want
        llm.engine.check_integrity()


def test_tiny_gqa3_with_tied_head_equals_one_rank(tiny_model):
    path, prompts = tiny_model("gqa3"), _prompts(6, seed=1)  # 6 heads, 2 KV heads, tied
    want = [o.token_ids for o in LLM(path, max_batch_tokens=16).generate(prompts, PARAMS)]
    with LLM(path, max_batch_tokens=16, tensor_parallel=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == want


def test_embedded_model_tp3_equals_one_rank():
    """SmolLM2-135M: 9 heads and 3 KV heads over 3 ranks (one KV head each)."""
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM("smollm2-135m", num_kv_blocks=128).chat(conversations, params)]
    with LLM("smollm2-135m", num_kv_blocks=128, tensor_parallel=3) as llm:
        assert [o.token_ids for o in llm.chat(conversations, params)] == want


def test_a_degree_that_does_not_divide_the_heads_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"num_kv_heads=2 is not divisible by 4"):
        LLM(tiny_model("gqa2"), tensor_parallel=4)
    with pytest.raises(ValueError, match=r"num_heads=6 is not divisible by 4"):
        LLM(tiny_model("gqa3"), tensor_parallel=4)
