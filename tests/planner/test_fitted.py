"""Least-squares fits of profiled step times, and the profile itself on a tiny model."""

import pytest

from pdserve.planner.fitted import FittedCost, fit_linear
from pdserve.planner.profile import ProfileConfig, profile


def test_fit_recovers_linear():
    rows = [[t, t * t] for t in (10, 50, 100, 400)]
    times = [0.01 + 0.002 * t + 1e-6 * sq for t, sq in rows]
    assert fit_linear(rows, times) == pytest.approx([0.01, 0.002, 1e-6], rel=1e-6)


def test_fit_drops_negative_terms():
    rows = [[1, 5], [2, 3], [3, 1], [4, 0]]
    coef = fit_linear(rows, [1.0, 2.0, 3.0, 4.0])
    assert min(coef) >= 0 and coef[1] == pytest.approx(1.0)


def test_save_load(tmp_path):
    cost = FittedCost({1: [0.01, 0.001, 0.0]}, {1: [0.02, 0.0, 0.0]}, [0.0, 1e-9], 1000, {1: 64})
    cost.save(tmp_path / "p.json")
    again = FittedCost.load(tmp_path / "p.json")
    assert again == cost
    assert again.prefill_s(100, 0) == pytest.approx(0.11)
    assert again.kv_capacity_tokens(2) == 0  # a degree not profiled


def test_profile_tiny_model(tiny_model):
    cfg = ProfileConfig(
        tiny_model("gqa2"),
        tp_degrees=(1, 2),
        prompt_lengths=(8, 32),
        split=2,
        decode_batches=(1, 4),
        decode_contexts=(8,),
        decode_steps=2,
        transfer_mib=(0.25, 1),
        repeats=1,
    )
    cost = profile(cfg)
    assert set(cost.prefill) == {1, 2} and len(cost.meta["points"]["prefill"][1]) == 4
    for tp in (1, 2):
        assert cost.prefill_s(32, 32**2, tp) > 0 and cost.decode_s(4, 40, tp) > 0
    assert cost.transfer_s(1 << 20) > 0
