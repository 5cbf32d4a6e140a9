"""Hybrid mode's prefill choice (router/prefill_choice.py) and the costs it is fed
(router/prefill_costs.py), on their own: exact cases of the rule."""

from __future__ import annotations

import math

import pytest

from pdserve.router.prefill_choice import (
    LOCAL,
    REASONS,
    REMOTE,
    PrefillCosts,
    PrefillInputs,
    choose_prefill,
)
from pdserve.router.prefill_costs import CostModel

# 1 ms per prompt token on either side, steps of 20 ms (decode) and 10 ms (prefill)
# beside their prompt tokens, 0.1 ms per token of KV
COSTS = PrefillCosts(
    local_step_s=0.02,
    local_token_s=0.001,
    remote_step_s=0.01,
    remote_token_s=0.001,
    transfer_token_s=0.0001,
)


def inputs(prompt: int, **kw) -> PrefillInputs:
    base = dict(
        prompt_tokens=prompt,
        local_hit_tokens=0,
        remote_hit_tokens=0,
        remote_queue_tokens=0,
        local_queue_tokens=0,
        running=0,
        max_batch_tokens=512,
        remote_max_batch_tokens=512,
        tpot_s=0.15,
    )
    return PrefillInputs(**{**base, **kw})


def test_short_prompt_goes_local_behind_a_long_prefill_queue():
    c = choose_prefill(inputs(18, running=4, remote_queue_tokens=2300), COSTS)
    assert (c.where, c.reason) == (LOCAL, "faster")
    # 18 ms + one step of 20 ms, against 2318 ms + 5 steps of 10 ms + 1.8 ms of transfer
    assert c.local_s == pytest.approx(0.038)
    assert c.remote_s == pytest.approx(2.3698)
    assert "18 tokens after hits locally" in c.detail and "prefill queue 2300" in c.detail


def test_long_prompt_with_an_idle_prefill_pool_goes_remote():
    # 2000 tokens at 512 a step beside 8 decodes: 4 steps x (504 ms + 20 ms) would stretch
    # the batch's steps to 524 ms, past 150 ms
    c = choose_prefill(inputs(2000, running=8), COSTS)
    assert (c.where, c.reason) == (REMOTE, "tpot")
    # with the batch's objective loose, it is still slower than the idle prefill pool
    # once the decode instance has prompts of its own queued
    c = choose_prefill(inputs(2000, running=8, tpot_s=1.0, local_queue_tokens=1000), COSTS)
    assert (c.where, c.reason) == (REMOTE, "faster")
    assert c.local_s == pytest.approx(3.0 + 6 * 0.02)
    assert c.remote_s == pytest.approx(2.0 + 4 * 0.01 + 0.2)


def test_tpot_slack_refuses_local_even_when_local_is_sooner():
    # 100 tokens: one chunk, a 120 ms step; sooner locally (120 ms vs 630 ms)
    fits = choose_prefill(inputs(100, running=3, remote_queue_tokens=500), COSTS)
    assert (fits.where, fits.reason) == (LOCAL, "faster")
    tight = choose_prefill(inputs(100, running=3, remote_queue_tokens=500, tpot_s=0.1), COSTS)
    assert (tight.where, tight.reason) == (REMOTE, "tpot")
    assert "past slo.tpot_ms=100" in tight.detail
    # an empty running batch has no TPOT to keep
    idle = choose_prefill(inputs(100, remote_queue_tokens=500, tpot_s=0.01), COSTS)
    assert (idle.where, idle.reason) == (LOCAL, "faster")


def test_mixed_prefill_tokens_spread_a_prompt_over_steps_within_tpot():
    """The decode pool's ``mixed_prefill_tokens`` caps the chunk beside a running batch:
    the step stays under the objective, and the prompt costs a step per chunk."""
    tight = inputs(100, running=3, remote_queue_tokens=500, tpot_s=0.1)
    assert choose_prefill(tight, COSTS).reason == "tpot"
    c = choose_prefill(PrefillInputs(**{**tight.__dict__, "mixed_prefill_tokens": 40}), COSTS)
    # chunks of 40: 3 steps of 20 ms + 100 ms of tokens; each step 60 ms < 100 ms
    assert (c.where, c.reason) == (LOCAL, "faster")
    assert c.local_s == pytest.approx(0.1 + 3 * 0.02)
    # idle, the cap does not apply: one step
    idle = PrefillInputs(**{**tight.__dict__, "running": 0, "mixed_prefill_tokens": 40})
    assert choose_prefill(idle, COSTS).local_s == pytest.approx(0.1 + 0.02)


def test_hits_count_on_their_own_side():
    # the decode instance holds 1984 of 2000 tokens: 16 tokens locally, no TPOT problem
    c = choose_prefill(inputs(2000, running=8, local_hit_tokens=1984), COSTS)
    assert (c.where, c.reason) == (LOCAL, "faster")
    # a hit on the prefill side only: remote computes 16, but sends all 2000 tokens' KV
    c = choose_prefill(inputs(2000, remote_hit_tokens=1984, tpot_s=10), COSTS)
    assert c.remote_s == pytest.approx(0.016 + 0.01 + 0.2)
    assert (c.where, c.reason) == (REMOTE, "faster")


def test_a_peer_decode_instance_counts_its_running_batch():
    """Without a prefill pool the remote side is a peer decode instance: its step carries
    its own decodes (``remote_step_s``), its budget shrinks by them and by its
    ``mixed_prefill_tokens``, and its TPOT is kept as the local one is."""
    peer = dict(remote_running=6, remote_mixed_prefill_tokens=50, remote_max_batch_tokens=512)
    # 200 tokens, the local batch (8) stretched past 150 ms by one chunk; the peer's
    # chunks of 50 keep its steps at 10 + 50 ms: remote, for TPOT
    c = choose_prefill(inputs(200, running=8, **peer), COSTS)
    assert (c.where, c.reason) == (REMOTE, "tpot")
    assert c.remote_s == pytest.approx(0.2 + 4 * 0.01 + 0.02)  # 4 steps of 50
    # the peer uncapped: its one 210 ms step would stretch its batch; local, even behind
    # a queue that makes it slower (1440 ms against 230 ms)
    uncapped = {**peer, "remote_mixed_prefill_tokens": None}
    c = choose_prefill(
        inputs(200, running=1, mixed_prefill_tokens=100, local_queue_tokens=1000, **uncapped),
        COSTS,
    )
    assert (c.where, c.reason) == (LOCAL, "tpot") and c.local_s > c.remote_s
    assert "a chunk on the peer would make its running batch's (6) steps 210.0 ms" in c.detail
    # stretched on both sides: the sooner one
    c = choose_prefill(inputs(200, running=8, local_queue_tokens=400, **uncapped), COSTS)
    assert (c.where, c.reason) == (REMOTE, "faster")
    assert (LOCAL, "tpot") in REASONS


def test_no_prefill_and_a_failed_transfer_go_local():
    c = choose_prefill(inputs(2000, running=8, prefill_alive=False), COSTS)
    assert (c.where, c.reason) == (LOCAL, "no_prefill") and math.isinf(c.remote_s)
    c = choose_prefill(inputs(2000, running=8, remote_failed=True), COSTS)
    assert (c.where, c.reason) == (LOCAL, "fallback")
    assert {(LOCAL, "no_prefill"), (LOCAL, "fallback"), (REMOTE, "tpot")} <= set(REASONS)


def test_costs_are_learned_from_step_rows_and_handoffs():
    m = CostModel(prefill_ms_per_token=2.0, transfer_mb_per_s=100.0)
    m.kv_bytes_per_token = 1000
    assert m.costs(running=0) == PrefillCosts(0.0, 0.002, 0.0, 0.002, 1e-5)

    def stats(steps, prefill_tokens, decodes, seconds):
        return {"steps_total": steps, "last_step": [prefill_tokens, 0, decodes, 0, seconds]}

    # decode steps: 5 ms + 0.4 ms per prompt token + 1 ms per decode; prefill steps:
    # 8 ms + 0.3 ms per token; the same step seen twice counts once
    shapes = [(0, 4), (64, 2), (128, 6), (16, 8), (0, 1), (100, 3)]
    for n in range(60):
        tokens, decodes = shapes[n % len(shapes)]
        row = stats(n, tokens, decodes, 0.005 + 0.0004 * tokens + 0.001 * decodes)
        m.observe_stats("decode-0", "decode", row)
        m.observe_stats("decode-0", "decode", {**row, "last_step": [0, 0, 0, 0, 9.0]})
        m.observe_stats(
            "prefill-0",
            "prefill",
            stats(n, 32 + 40 * (n % 4), 0, 0.008 + 0.0003 * (32 + 40 * (n % 4))),
        )
    m.observe_transfer(kv_bytes=2_000_000, transfer_s=0.01)  # 200 MB/s, weighted 0.2
    c = m.costs(running=4)
    assert c.local_step_s == pytest.approx(0.005 + 0.004, rel=0.05)
    assert c.local_token_s == pytest.approx(0.0004, rel=0.05)
    assert c.remote_step_s == pytest.approx(0.008, rel=0.05)
    assert c.remote_token_s == pytest.approx(0.0003, rel=0.05)
    assert c.transfer_token_s == pytest.approx(1000 / 120e6)


def test_an_undetermined_cost_stays_at_its_prior():
    # a decode pool that only ever decoded: its cost per prompt token is the default
    m = CostModel(prefill_ms_per_token=2.0, transfer_mb_per_s=100.0)
    for n in range(30):
        row = [0, 0, 1 + n % 5, 0, 0.004 + 0.001 * (1 + n % 5)]
        m.observe_stats("decode-0", "decode", {"steps_total": n, "last_step": row})
    c = m.costs(running=2)
    assert c.local_token_s == pytest.approx(0.002)
    assert c.local_step_s == pytest.approx(0.006, rel=0.05)
