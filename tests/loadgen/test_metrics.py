"""SLO attainment, summaries and the goodput search on synthetic latency records whose
answer is known."""

from __future__ import annotations

import math

import pytest

from pdserve.loadgen.metrics import (
    SLO,
    Record,
    attainment,
    goodput_from,
    percentile,
    search_goodput,
    summarize,
)

SLO_ = SLO(ttft_ms=100, tpot_ms=10, attainment=0.9)


def record(i=0, ttft=50.0, tpot=5.0, **kw) -> Record:
    base = dict(
        index=i,
        sent_s=i * 0.1,
        prompt_tokens=10,
        output_len=4,
        completion_tokens=4,
        e2e_ms=ttft + 3 * tpot,
        finish_reason="length",
    )
    return Record(ttft_ms=ttft, tpot_ms=tpot, **{**base, **kw})


def test_attainment_both_and_each():
    records = [
        record(0),  # meets both
        record(1, ttft=150),  # TTFT missed
        record(2, tpot=20),  # TPOT missed
        record(3, ttft=100, tpot=10),  # on the line: meets
        record(4, error="UNAVAILABLE: draining"),  # failed: meets neither
    ]
    s = summarize(records, SLO_)
    assert s["attainment"] == attainment(records, SLO_) == 2 / 5
    assert s["attainment_ttft"] == 3 / 5
    assert s["attainment_tpot"] == 3 / 5
    assert (s["requests"], s["completed"], s["errors"]) == (5, 4, 1)
    assert attainment([], SLO_) == 0.0


def test_summary_throughput_and_percentiles():
    records = [record(i, ttft=10.0 * (i + 1), tpot=1.0, e2e_ms=1000.0) for i in range(10)]
    s = summarize(records, SLO_)
    # sent at 0.0 .. 0.9 s, each 1 s long: the run spans 1.9 s
    assert s["duration_s"] == pytest.approx(1.9)
    assert s["request_throughput"] == pytest.approx(10 / 1.9)
    assert s["output_token_throughput"] == pytest.approx(40 / 1.9)
    assert s["p50_ttft_ms"] == pytest.approx(55.0)
    assert s["p90_ttft_ms"] == pytest.approx(91.0)
    assert s["p99_ttft_ms"] == pytest.approx(99.1)
    assert s["mean_tpot_ms"] == 1.0
    assert percentile([], 50) is None


def test_summary_of_failures_only():
    s = summarize([record(0, error="INTERNAL: x", ttft=math.inf)], SLO_)
    assert s["attainment"] == 0 and s["request_throughput"] == 0 and s["p50_ttft_ms"] is None
    assert record(0, error="x", ttft=math.inf).to_dict()["ttft_ms"] is None


def synthetic(capacity: float):
    """rate -> 1000 records whose attainment is 1 - rate / (10 * capacity), rounded
    down: the target 0.9 is met exactly up to rate == capacity."""
    calls = []

    def run(rate: float) -> list[Record]:
        calls.append(rate)
        good = math.floor(1000 * max(0.0, 1 - rate / (10 * capacity)) + 1e-9)
        return [record(i, ttft=50 if i < good else 500) for i in range(1000)]

    return run, calls


def test_sweep_without_search():
    run, calls = synthetic(capacity=2.0)
    result = search_goodput(run, SLO_, [0.5, 1, 2, 4], search=False)
    assert calls == [0.5, 1, 2, 4]
    assert result.met and result.goodput == 2 and result.lowest_failing == 4
    assert result.attainment == {0.5: 0.975, 1: 0.95, 2: 0.9, 4: 0.8}


@pytest.mark.parametrize("start", [[0.1], [100.0], [0.5, 50.0]])
def test_search_finds_the_known_goodput(start):
    run, calls = synthetic(capacity=3.0)
    result = search_goodput(run, SLO_, start, rel_tol=0.02)
    assert result.met
    assert 3.0 / 1.02 <= result.goodput <= 3.0
    assert result.lowest_failing <= 3.0 * 1.02 + 1e-9
    assert len(calls) <= 12


def test_no_rate_meets_the_target():
    def run(rate):  # every request misses TTFT at any rate
        return [record(i, ttft=1000) for i in range(10)]

    result = search_goodput(run, SLO_, [1, 2], min_rate=0.1)
    assert not result.met and result.goodput == 0.0
    assert min(result.attainment) < 0.2  # it halved down to the floor
    assert goodput_from({}, 0.9).goodput == 0.0


def test_a_lucky_pass_above_a_failure_does_not_count():
    result = goodput_from({1: 0.95, 2: 0.85, 4: 0.92}, 0.9)
    assert result.goodput == 1 and result.lowest_failing == 2
