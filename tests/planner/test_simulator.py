"""Hand-computable cases of the cluster simulator."""

import pytest

from pdserve.loadgen.metrics import SLO, summarize
from pdserve.planner.cluster_spec import ClusterSpec, PoolSpec
from pdserve.planner.simulator import simulate
from tests.planner.costs import LinearCost

DISAGG = ClusterSpec("disaggregated", PoolSpec(), PoolSpec())
COLOC = ClusterSpec("colocated", colocated=PoolSpec())


def test_one_request_disaggregated_idle():
    cost = LinearCost(transfer=0.05)
    [r] = simulate(DISAGG, cost, [(1.0, 100, 11)])
    prefill = 0.01 + 0.1
    # layer-wise: the transfer's share not hidden by the last chunk's step
    assert r.ttft_ms == pytest.approx((prefill + 0.0) * 1000)
    assert r.tpot_ms == pytest.approx(20.0)
    assert r.e2e_ms == pytest.approx((prefill + 10 * 0.02) * 1000)
    assert r.queue_ms == 0 and r.instances == ["prefill-0", "decode-0"]
    assert r.kv_bytes == 100 * 1000


def test_transfer_not_hidden():
    cost = LinearCost(transfer=0.5)
    [r] = simulate(DISAGG, cost, [(0.0, 100, 2)])
    assert r.ttft_ms == pytest.approx((0.11 + 0.5 - 0.11) * 1000)
    whole = ClusterSpec("disaggregated", layerwise=False)
    [r] = simulate(whole, cost, [(0.0, 100, 2)])
    assert r.ttft_ms == pytest.approx((0.11 + 0.5) * 1000)


def test_one_request_colocated_idle():
    [r] = simulate(COLOC, LinearCost(), [(0.0, 1000, 5)])
    # two chunks of 512 and 488 tokens, then 4 decode steps
    assert r.ttft_ms == pytest.approx((0.01 + 0.512 + 0.01 + 0.488) * 1000)
    assert r.tpot_ms == pytest.approx(20.0)


def test_burst_serializes_prefill():
    # 4 prompts of 512 tokens at once: one per prefill step (the token budget)
    cost = LinearCost()
    records = simulate(DISAGG, cost, [(0.0, 512, 2)] * 4)
    step = 0.01 + 0.512
    for i, r in enumerate(records):
        assert r.ttft_ms == pytest.approx((i + 1) * step * 1000)


def test_burst_shares_prefill_steps():
    # 4 prompts of 128 tokens fit one step of 512 tokens: all get the first token at once
    records = simulate(DISAGG, LinearCost(), [(0.0, 128, 2)] * 4)
    assert {round(r.ttft_ms, 6) for r in records} == {round((0.01 + 0.512) * 1000, 6)}


def test_decode_capacity_queues_at_router():
    pool = PoolSpec(max_batch_size=2)
    cluster = ClusterSpec("disaggregated", PoolSpec(), pool)
    records = simulate(cluster, LinearCost(), [(0.0, 10, 101)] * 3)
    # the third waits until a decode slot frees: 100 decode steps of 20 ms
    assert records[0].queue_ms == records[1].queue_ms == 0
    assert records[2].queue_ms == pytest.approx((0.02 + 100 * 0.02) * 1000, rel=0.02)


def test_overload_ttft_grows_linearly():
    # service: 0.522 s per 512-token prompt; arrivals every 0.261 s (twice the capacity)
    cost = LinearCost()
    gap = 0.261
    reqs = [(i * gap, 512, 2) for i in range(40)]
    records = simulate(DISAGG, cost, reqs)
    ttft = [r.ttft_ms / 1000 for r in records]
    # request i finishes prefill at (i+1) x 0.522: TTFT = (i+1) x 0.522 - i x 0.261
    for i in (0, 10, 39):
        assert ttft[i] == pytest.approx((i + 1) * 0.522 - i * gap)
    slopes = [ttft[i + 1] - ttft[i] for i in range(39)]
    assert min(slopes) == pytest.approx(max(slopes)) == pytest.approx(0.522 - gap)


def test_colocated_prefill_interference():
    # a long prompt arriving mid-decode makes the running request's step longer
    records = simulate(COLOC, LinearCost(), [(0.0, 10, 50), (0.1, 2000, 2)])
    alone = simulate(COLOC, LinearCost(), [(0.0, 10, 50)])
    assert records[0].tpot_ms > alone[0].tpot_ms
    s = summarize(records, SLO(1000, 25))
    assert s["attainment_tpot"] < 1


def test_request_larger_than_cache_fails():
    cost = LinearCost(capacity_tokens=64)
    records = simulate(COLOC, cost, [(0.0, 100, 5), (0.0, 10, 5)])
    assert records[0].error and records[1].ok


def test_simulate_bench_replays_the_bench_requests():
    from pdserve.loadgen.workloads import WorkloadSpec
    from pdserve.planner.validate import simulate_bench

    spec = WorkloadSpec("longprompt", long_prompt_mean=64, long_output_mean=8, dataset_limit=200)
    out, result = simulate_bench(
        "configs/local-disagg.yaml", LinearCost(), spec, [2, 0.5], 10, SLO(ttft_ms=1e6)
    )
    assert list(out) == [0.5, 2] and [s["requests"] for s, _ in out.values()] == [5, 20]
    assert result.met and result.goodput == 2  # no search: the rates given
    assert all(r.instances == ["prefill-0", "decode-0"] for _, rs in out.values() for r in rs)


def test_hybrid_prefills_locally_unless_the_running_batch_has_no_slack():
    cost = LinearCost(transfer=0.05)
    hybrid = ClusterSpec("hybrid", PoolSpec(), PoolSpec(), tpot_ms=150)
    # idle: 110 ms locally against 110 + 50 ms remotely; one mixed step of 100 tokens
    [r] = simulate(hybrid, cost, [(0.0, 100, 5)])
    assert r.instances == ["decode-0"] and r.kv_bytes == 0
    assert r.ttft_ms == pytest.approx(110.0)
    # beside a running request, a 511-token chunk would make its step ~540 ms > 150 ms
    runner, long = simulate(hybrid, cost, [(0.0, 10, 200), (0.5, 2000, 2)])
    assert runner.instances == ["decode-0"]
    assert long.instances == ["prefill-0", "decode-0"]
    # with no objective the same prompt stays local when the transfer costs more
    slow = LinearCost(transfer=0.5)
    loose = ClusterSpec("hybrid", PoolSpec(), PoolSpec())
    _, long = simulate(loose, slow, [(0.0, 10, 200), (0.5, 2000, 2)])
    assert long.instances == ["decode-0"]


def test_hybrid_without_a_prefill_pool_prefills_on_the_peer_with_slack():
    """Two decode instances prefilling for each other: a prompt stays on an idle decode
    instance whose peer runs a batch, and goes to the peer when its own instance runs a
    batch and the peer only computes a prompt (no decodes whose steps it would stretch)."""
    cost = LinearCost(transfer=0.05)
    peers = ClusterSpec("hybrid", PoolSpec(instances=0), PoolSpec(instances=2), tpot_ms=150)
    runner, a, b = simulate(peers, cost, [(0.0, 10, 200), (0.05, 3000, 2), (0.5, 2000, 2)])
    assert runner.instances == ["decode-0"]
    assert a.instances == ["decode-1"] and a.kv_bytes == 0  # decode-0's batch has no slack
    # decode-0 (more free blocks) decodes it; decode-1, still computing a's prompt,
    # computes it after a's chunks (FCFS) and hands it off
    assert b.instances == ["decode-1", "decode-0"] and b.kv_bytes == 2000 * 1000


def test_free_decode_steps_run_at_once_with_the_same_records():
    """A cost model that leaves decode out (the planner's prefill-only phase) runs a
    batch's free steps up to its next finish in one event: every record equals the
    step-by-step run's, whose steps cost next to nothing."""
    reqs = [(0.01 * i, 50 + 37 * i, 1 + 97 * i % 400) for i in range(40)]
    free = simulate(DISAGG, LinearCost(decode_base=0.0), reqs)
    tiny = simulate(DISAGG, LinearCost(decode_base=1e-12), reqs)
    for a, b in zip(free, tiny, strict=True):
        assert a.ttft_ms == pytest.approx(b.ttft_ms, abs=1e-6)
        assert a.e2e_ms == pytest.approx(b.e2e_ms, abs=1e-6)
        assert a.instances == b.instances and a.error == b.error


def test_mixed_prefill_tokens_cap_the_chunks_beside_decodes():
    """As the engine's scheduler does: beside running decodes a step carries at most
    ``mixed_prefill_tokens`` prompt tokens, so a long prompt arriving mid-decode takes
    several short steps (steps of 10 + 20 + 20 ms) instead of one long one: the longest
    token gap of the running request shrinks, its mean grows by each chunk's fixed cost."""
    reqs = [(0.0, 10, 50), (0.1, 200, 2)]
    free = simulate(ClusterSpec("colocated", colocated=PoolSpec(instances=1)), LinearCost(), reqs)
    capped_pool = PoolSpec(instances=1, mixed_prefill_tokens=20)
    capped = simulate(ClusterSpec("colocated", colocated=capped_pool), LinearCost(), reqs)
    # the 200-token prompt: 10 chunks of 20 beside r0's decodes, 50 ms each, against one
    # step of 10 + 200 + 20 ms after the one under way
    assert capped[1].ttft_ms >= 10 * 50 - 1e-6
    assert free[1].ttft_ms < 260
    # r0: 10 steps of 50 ms (a token each) in place of one of 230 ms (one token) and 9
    # plain decodes of 20 ms: 500 - (230 + 180) = 90 ms more in all, none longer than 50
    assert capped[0].e2e_ms - free[0].e2e_ms == pytest.approx(90, abs=1e-3)
