"""Greedy output does not depend on chunk size, batch composition, arrival step or cache size."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.reservation import Reservation
from tests.engine_utils import run_staggered

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(n: int, seed: int = 3, lo: int = 3, hi: int = 90) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 256, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Each prompt run alone with an ample cache and its whole prompt in one chunk."""
    path = tiny_model("gqa2")
    llm = LLM(path, max_batch_tokens=1024, num_kv_blocks=256)
    prompts = _prompts(16)
    return path, prompts, [llm.generate(p, GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1024])
def test_chunk_size_does_not_change_output(reference, chunk):
    path, prompts, expected = reference
    llm = LLM(path, max_batch_tokens=chunk, num_kv_blocks=256)
    subset = [0, 5, 11] if chunk == 1 else range(len(prompts))
    for i in subset:
        assert llm.generate(prompts[i], GREEDY)[0].token_ids == expected[i]
    llm.engine.blocks.check_integrity()


def test_batch_with_staggered_arrivals(reference):
    """16 requests of different lengths join a running batch at different steps."""
    path, prompts, expected = reference
    engine = LLMEngine(path, EngineConfig(max_batch_tokens=48, num_kv_blocks=256))
    arrivals: dict[int, list] = {}
    for i, ids in enumerate(prompts):
        arrivals.setdefault((i * 3) % 11, []).append((f"r{i}", ids))
    done = run_staggered(engine, arrivals, GREEDY)
    assert [done[f"r{i}"] for i in range(len(prompts))] == expected
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == 256


def test_small_cache_preempts_and_still_matches(reference):
    """A cache far too small for the batch: requests are preempted, recomputed, and
    every output equals the ample-cache output; all blocks come back."""
    path, prompts, expected = reference
    engine = LLMEngine(path, EngineConfig(max_batch_tokens=64, num_kv_blocks=12, block_size=16))
    arrivals = {0: [(f"r{i}", ids) for i, ids in enumerate(prompts)]}
    done = run_staggered(engine, arrivals, GREEDY)
    assert [done[f"r{i}"] for i in range(len(prompts))] == expected
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == 12


def test_preemption_happens_with_small_cache(reference):
    path, prompts, _ = reference
    engine = LLMEngine(path, EngineConfig(max_batch_tokens=64, num_kv_blocks=12, block_size=16))
    requests = [engine.add_request(f"r{i}", ids, GREEDY) for i, ids in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
        engine.blocks.check_integrity()
    assert sum(r.num_preemptions for r in requests) > 0
    assert all(r.finish_reason == "length" for r in requests)


def test_blocks_reserved_for_arriving_kv_make_a_request_wait_not_end(reference):
    """A running request that cannot grow because blocks are reserved for KV on its way
    (a decode instance's reservation: a request waiting for KV) is preempted and
    waits; it is not finished as too long for the cache. Once the reservation is
    released it resumes and its output is the ample-cache output."""
    path, prompts, expected = reference
    i = next(i for i, p in enumerate(prompts) if 16 < len(p) <= 48)  # 2-3 blocks + 24
    engine = LLMEngine(path, EngineConfig(max_batch_tokens=64, num_kv_blocks=8, block_size=16))
    request = engine.add_request("r", prompts[i], GREEDY)
    engine.step()  # its prompt in one chunk
    arriving = list(range(3, 3 + 16 * engine.blocks.num_free_blocks - 1))  # and one more:
    assert isinstance(engine.reserve("arriving", arriving, GREEDY), Reservation)  # all free
    made = list(request.output_token_ids)
    while request.status.name == "RUNNING":
        engine.step()
    assert request.finish_reason is None and request.num_preemptions == 1
    assert engine.has_unfinished_requests()
    engine.release("arriving")  # the reservation ends (its transfer failed)
    while engine.has_unfinished_requests():
        engine.step()
        engine.blocks.check_integrity()
    assert made and request.output_token_ids == expected[i]
    assert engine.blocks.num_free_blocks == 8


def test_abort_frees_blocks(reference):
    path, prompts, _ = reference
    engine = LLMEngine(path, EngineConfig(max_batch_tokens=32, num_kv_blocks=64))
    for i, ids in enumerate(prompts[:6]):
        engine.add_request(f"r{i}", ids, GREEDY)
    for _ in range(4):
        engine.step()
    for i in range(6):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == 64


def test_max_batch_size_bounds_running(reference):
    path, prompts, expected = reference
    engine = LLMEngine(path, EngineConfig(max_batch_size=3, num_kv_blocks=256))
    for i, ids in enumerate(prompts[:8]):
        engine.add_request(f"r{i}", ids, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 3


def test_embedded_model_chunks_and_batch():
    """SmolLM2: chunk sizes 7 and whole prompt, alone and inside a batch, agree."""
    text = (
        "Disaggregated serving runs the prompt on one pool of workers and the decode on "
        "another, moving the KV cache between them. Explain why this helps latency:"
    )
    whole = LLM("smollm2-135m", max_batch_tokens=512, num_kv_blocks=128)
    ids = whole.tokenizer.encode(text)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = whole.generate(ids, params)[0].token_ids
    chunked = LLM("smollm2-135m", max_batch_tokens=7, num_kv_blocks=128)
    assert chunked.generate(ids, params)[0].token_ids == expected
    others = [whole.tokenizer.encode(t) for t in ("Hello there", "1, 2, 3, 4,", "Why is the sky")]
    outs = chunked.generate([others[0], ids, others[1], others[2]], params)
    assert outs[1].token_ids == expected


def test_mixed_prefill_tokens_bound_prompt_chunks_beside_decodes(reference):
    """With ``mixed_prefill_tokens``, a step that decodes carries at most that many
    prompt tokens (a prompt spreads over several steps); a step with no decodes spends
    the whole ``max_batch_tokens``; the outputs are the same."""
    path, prompts, expected = reference
    config = EngineConfig(max_batch_tokens=256, mixed_prefill_tokens=9, num_kv_blocks=256)
    engine = LLMEngine(path, config)
    shapes = []  # (decodes, prompt tokens) of every step
    schedule = engine.scheduler.schedule

    def observed():
        batch = schedule()
        decodes = sum(1 for r, n in batch.items if r.num_pending_tokens == 1 and n == 1)
        shapes.append((decodes, sum(n for _, n in batch.items) - decodes))
        return batch

    engine.scheduler.schedule = observed
    arrivals: dict[int, list] = {}
    for i, ids in enumerate(prompts):
        arrivals.setdefault((i * 3) % 11, []).append((f"r{i}", ids))
    done = run_staggered(engine, arrivals, GREEDY)
    assert [done[f"r{i}"] for i in range(len(prompts))] == expected
    engine.blocks.check_integrity()
    assert all(tokens <= 9 for decodes, tokens in shapes if decodes)
    assert any(decodes and tokens == 9 for decodes, tokens in shapes)  # the cap was reached
    assert shapes[0][0] == 0 and shapes[0][1] > 9  # the first step: prompts only
    with pytest.raises(ValueError, match="mixed_prefill_tokens=0: must be None or a positive"):
        EngineConfig(mixed_prefill_tokens=0).validate()
