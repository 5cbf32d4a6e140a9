"""router/metrics.py without a cluster: how token gaps are counted, and that every
refusal the router can raise has a reason the refusal counter knows (an unknown one
would turn the refusal into an internal error)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pdserve.router.metrics import REFUSAL_REASONS, RouterMetrics, token_gaps
from pdserve.router.request import Refusal

ROUTER = Path(__file__).resolve().parents[2] / "router"


def test_token_gaps_share_a_batch_and_sum_to_last_minus_first():
    # first batch of 2 tokens at 1.0, then 1 token at 1.5, then 3 tokens at 2.4
    walls = [1.0, 1.0, 1.5, 2.4, 2.4, 2.4]
    gaps = token_gaps(walls)
    assert gaps == pytest.approx([0.0, 0.5, 0.3, 0.3, 0.3])
    assert len(gaps) == len(walls) - 1 and sum(gaps) == pytest.approx(walls[-1] - walls[0])
    assert token_gaps([3.0]) == [] and token_gaps([]) == []


def test_every_refusal_kind_but_busy_is_a_reason_and_every_busy_one_names_its_bound():
    """Every ``Refused(...)`` in router/ (BUSY ones with ``reason=``) and every
    ``refused("...")`` count names a reason of ``REFUSAL_REASONS``."""
    assert {k.value for k in Refusal if k is not Refusal.BUSY} <= set(REFUSAL_REASONS)
    unnamed = []
    for path in ROUTER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if called == "refused" and isinstance(node.args[0], ast.Constant):
                assert node.args[0].value in REFUSAL_REASONS, f"{path.name}:{node.lineno}"
            if called != "Refused":
                continue
            kind = ast.unparse(node.args[0]) if node.args else ""
            reason = [k.value for k in node.keywords if k.arg == "reason"]
            if kind == "Refusal.BUSY" and not reason:
                unnamed.append(f"{path.name}:{node.lineno}")
            for r in reason:
                assert isinstance(r, ast.Constant) and r.value in REFUSAL_REASONS, ast.unparse(r)
    assert not unnamed, f"BUSY refusals without a reason: {unnamed}"


def test_an_unknown_reason_is_refused_naming_the_allowed_ones():
    metrics = RouterMetrics("m", {"ttft_ms": 1000.0, "tpot_ms": 150.0})
    with pytest.raises(ValueError, match="reason='busy'.*queue_full"):
        metrics.refused("busy")
