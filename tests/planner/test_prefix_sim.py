"""Prefix hits in the cluster simulator, on hand-made requests (block size 4, the
linear cost model): what is cached where, what a turn computes and transfers, and
where each policy sends it. Every number is computed by hand in the comments."""

import pytest

from pdserve.loadgen.workloads import WorkloadSpec
from pdserve.planner.cluster_spec import ClusterSpec, PoolSpec
from pdserve.planner.prefix import PrefixLRU, SimInput
from pdserve.planner.simulator import simulate
from pdserve.planner.workload import sim_inputs
from tests.planner.costs import LinearCost

POOL = PoolSpec(block_size=4, kv_blocks=64)
COLOC = ClusterSpec("colocated", colocated=POOL)
DISAGG = ClusterSpec("disaggregated", POOL, POOL)

PROMPT = list(range(10))  # 10 tokens: 2 full blocks
ANSWER = [100, 101]  # prompt + answer: 12 tokens, 3 full blocks
NEXT = PROMPT + ANSWER + [50, 51, 52]  # the next turn: 15 tokens, 3 full blocks


def conversation(think_s: float = 1.0) -> list[SimInput]:
    return [SimInput(0.0, PROMPT, ANSWER), SimInput(0.0, NEXT, [7, 7], 0, think_s)]


@pytest.mark.timeout(30)
def test_lru_match_refresh_evict_and_cap():
    lru = PrefixLRU(3)
    lru.insert([1, 2, 3])
    assert lru.match([1, 2, 9], 5) == 2  # refreshes 1 and 2: 3 is now the oldest
    lru.insert([4])
    assert list(lru.keys) == [1, 2, 4]
    assert lru.peek([1, 2, 4], 2) == 2 and lru.peek([3], 5) == 0


@pytest.mark.timeout(30)
def test_colocated_next_turn_computes_only_its_suffix():
    first, second = simulate(COLOC, LinearCost(), conversation())
    # turn 0: 10 tokens in one step, 0.01 + 0.010 s; one decode step of 0.02 s
    assert first.ttft_ms == pytest.approx(20) and first.e2e_ms == pytest.approx(40)
    assert first.cached_tokens == 0
    # turn 1 arrives 1 s after turn 0 finished (0.04 s); the instance holds prompt +
    # answer (3 blocks); the hit is capped at (15 - 1) // 4 = 3 blocks: 12 tokens
    assert second.sent_s == pytest.approx(1.04)
    assert second.cached_tokens == 12
    assert second.ttft_ms == pytest.approx((0.01 + 0.003) * 1000)  # 3 tokens computed
    assert second.instances == ["colocated-0"] and second.kv_bytes == 0


@pytest.mark.timeout(30)
def test_disaggregated_next_turn_transfers_only_what_decode_lacks():
    first, second = simulate(DISAGG, LinearCost(), conversation())
    assert first.kv_bytes == 10 * 1000 and first.cached_tokens == 0
    # the prefill instance holds turn 0's prompt blocks (2 blocks, 8 tokens): it
    # computes 7 tokens; the decode instance holds prompt + answer (3 blocks, 12
    # tokens): 3 tokens' KV move
    assert second.cached_tokens == 8
    assert second.ttft_ms == pytest.approx((0.01 + 0.007) * 1000)
    assert second.kv_bytes == 3 * 1000


@pytest.mark.timeout(30)
def test_caching_off_computes_and_sends_everything():
    off = PoolSpec(block_size=4, kv_blocks=64, prefix_caching=False)
    _, second = simulate(ClusterSpec("disaggregated", off, off), LinearCost(), conversation())
    assert second.cached_tokens == 0 and second.kv_bytes == 15 * 1000
    assert second.ttft_ms == pytest.approx((0.01 + 0.015) * 1000)
    # requests given as lengths only: no tokens, no hits (the simulator as before)
    _, again = simulate(DISAGG, LinearCost(), [(0.0, 10, 2), (1.0, 15, 2)])
    assert again.cached_tokens == 0 and again.kv_bytes == 15 * 1000


@pytest.mark.timeout(30)
def test_cache_aware_sends_the_turn_to_its_cache_least_loaded_to_the_idle():
    # turn 0 (200 tokens) on colocated-0 ends at 0.23 s (a 0.21 s step, one decode);
    # a request at 0.5 s (both idle: the first) holds 10 blocks there until ~1.1 s;
    # turn 1 (205 tokens) arrives at 0.73 s
    pool = PoolSpec(instances=2, block_size=4, kv_blocks=256)
    prompt = list(range(200))
    turns = [
        SimInput(0.0, prompt, ANSWER),
        SimInput(0.0, prompt + ANSWER + [50, 51, 52], [7, 7], 0, 0.5),
        SimInput(0.5, list(range(300, 310)), [0] * 30),
    ]
    # cache_aware's cost in blocks: colocated-0 misses ceil(5 / 4) = 2 (50 blocks hit)
    # + 10 held = 12; colocated-1 misses ceil(205 / 4) = 52
    for policy, where, cached in [
        ("least_loaded", "colocated-1", 0),
        ("cache_aware", "colocated-0", 200),
    ]:
        cluster = ClusterSpec("colocated", colocated=pool, policy=policy)
        first, second, other = simulate(cluster, LinearCost(), turns)
        assert first.instances == other.instances == ["colocated-0"]
        assert second.sent_s == pytest.approx(0.73)
        assert second.instances == [where] and second.cached_tokens == cached


@pytest.mark.timeout(30)
def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy 'nearest': allowed values are least_loaded"):
        ClusterSpec("colocated", policy="nearest")


@pytest.mark.timeout(120)
def test_multiturn_workload_hits_its_own_history():
    spec = WorkloadSpec("multiturn", dataset_limit=200, max_output_tokens=16, think_time_s=1.0)
    inputs = sim_inputs(spec, 4, 1.0, 8192)
    big = ClusterSpec("colocated", colocated=PoolSpec(block_size=4, kv_blocks=8192))
    records = simulate(big, LinearCost(), inputs)
    assert len(records) == len(inputs) and all(r.error is None for r in records)
    firsts = [item.prompt_ids for item in inputs if item.follows is None]
    head = next(i for i, col in enumerate(zip(*firsts, strict=False)) if len(set(col)) > 1)
    assert head > 20  # the template's default system prompt
    for item, rec in zip(inputs, records, strict=True):
        if item.follows is None:  # a conversation's first turn: at most the shared head
            assert rec.cached_tokens in (0, head // 4 * 4)
            continue
        prev = inputs[item.follows]
        # one instance, room for everything: the history's full blocks, capped
        history = len(prev.prompt_ids) + len(prev.output_ids)
        blocks = min(history // 4, (len(item.prompt_ids) - 1) // 4)
        assert item.prompt_ids[:history] == prev.prompt_ids + prev.output_ids
        assert rec.cached_tokens == blocks * 4
        assert rec.sent_s >= records[item.follows].sent_s + item.think_s
