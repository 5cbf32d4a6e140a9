"""Prefix caching in one engine: greedy outputs with it on equal those with it off
(shared prefixes, eviction, preemption, tensor parallelism, both attention backends),
the prompt tokens served from the cache are reported, and random shared-prefix batches
keep every block accounted for (``check_integrity()`` after every step)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.engine_utils import run_staggered

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _shared_prompts(seed: int = 5) -> list[list[int]]:
    """Two families of prompts: each family shares a 40-token head (2.5 blocks of 16),
    then goes its own way; one prompt is exactly another's head plus a block."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 256, (n,), generator=g).tolist()

    heads = [ids(40), ids(40)]
    prompts = [h + ids(int(n)) for h in heads for n in (5, 17, 33)]
    prompts.append(prompts[0][:32])  # two full cached blocks: one is recomputed
    return prompts


@pytest.fixture(scope="module")
def expected(tiny_model):
    """Each prompt alone, with caching off."""
    path = tiny_model("gqa2")
    llm = LLM(path, num_kv_blocks=128, enable_prefix_caching=False)
    prompts = _shared_prompts()
    return path, prompts, [llm.generate(p, GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shared_prefixes_match_caching_off_and_report_hits(expected, backend):
    path, prompts, want = expected
    llm = LLM(path, num_kv_blocks=128, max_batch_tokens=64, attention_backend=backend)
    first = llm.generate(prompts[0], GREEDY)[0]
    assert first.token_ids == want[0] and first.num_cached_tokens == 0
    outs = llm.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in outs] == want[1:]
    # the family's 2 full head blocks are hits once the first prompt committed them; the
    # last prompt (32 tokens, both blocks cached) recomputes its last block
    hits = [o.num_cached_tokens for o in outs]
    assert hits[:2] == [32, 32] and hits[-1] == 16
    blocks = llm.engine.blocks
    blocks.check_integrity()
    assert blocks.num_free_blocks == 128 and blocks.num_cached_blocks > 0
    s = llm.engine.scheduler
    assert s.num_hit_tokens == sum(hits) and s.num_queried_tokens == sum(map(len, prompts))


def test_eviction_and_preemption_keep_outputs(expected):
    """A cache of 10 blocks: batches preempt, cached blocks are evicted and reused, and
    the outputs stay those of caching off."""
    path, prompts, want = expected
    engine = LLMEngine(path, EngineConfig(max_batch_tokens=32, num_kv_blocks=10))
    for round_ in range(2):  # the second round finds some of the first's blocks
        arrivals = {i: [(f"r{round_}-{i}", p)] for i, p in enumerate(prompts)}
        done = run_staggered(engine, arrivals, GREEDY)
        assert [done[f"r{round_}-{i}"] for i in range(len(prompts))] == want
        engine.blocks.check_integrity()
        assert engine.blocks.num_free_blocks == 10
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_hit_tokens > 0


def test_a_turn_reuses_the_previous_turns_generated_blocks(tiny_model):
    """The next turn's prompt = the last prompt + its output + more: the blocks the
    decode steps filled are hits too."""
    path = tiny_model("gqa2")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    on, off = LLM(path, num_kv_blocks=64), LLM(path, num_kv_blocks=64, enable_prefix_caching=False)
    turn, computed = list(range(5, 25)), 0
    for _ in range(3):
        a, b = on.generate(turn, params)[0], off.generate(turn, params)[0]
        assert a.token_ids == b.token_ids
        assert a.num_cached_tokens == computed // 16 * 16
        history = turn + a.token_ids
        computed = len(history) - 1  # the last output token was sampled, never computed
        turn = history + [7, 8, 9]
    assert computed > 100
    on.engine.blocks.check_integrity()


@pytest.mark.timeout(240)
def test_tensor_parallel_with_caching_equals_one_rank(expected):
    path, prompts, want = expected
    with LLM(path, num_kv_blocks=64, max_batch_tokens=32, tensor_parallel=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        again = llm.generate(prompts[:3], GREEDY)
        assert [o.token_ids for o in again] == want[:3]
        assert all(o.num_cached_tokens >= 32 for o in again)
        llm.engine.blocks.check_integrity()


@pytest.fixture(scope="module")
def fuzz_engine(tiny_model):
    return LLMEngine(
        tiny_model("gqa2"), EngineConfig(max_batch_tokens=24, num_kv_blocks=14, block_size=4)
    )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    heads=st.lists(st.lists(st.integers(3, 40), min_size=1, max_size=14), min_size=1, max_size=3),
    picks=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(3, 40), max_size=9), st.integers(0, 3)),
        min_size=1,
        max_size=8,
    ),
    aborts=st.sets(st.integers(0, 7), max_size=2),
)
def test_random_shared_prefix_batches_keep_every_block_accounted(fuzz_engine, heads, picks, aborts):
    """Random prompts built from a few shared heads, arriving at random steps, some
    aborted mid-way, on a cache small enough to preempt and evict: the integrity check
    holds after every step and every block is free at the end."""
    engine = fuzz_engine
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    arrivals: dict[int, list[str]] = {}
    prompts = {}
    for i, (h, tail, step) in enumerate(picks):
        prompts[f"f{i}"] = heads[h % len(heads)] + tail
        arrivals.setdefault(step, []).append(f"f{i}")
    step = 0
    while arrivals or engine.has_unfinished_requests():
        for rid in arrivals.pop(step, []):
            engine.add_request(rid, prompts[rid], params)
        if step == 2:
            for i in aborts:
                engine.abort_request(f"f{i}")
        engine.step()
        engine.blocks.check_integrity()
        step += 1
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and not blocks.tables
