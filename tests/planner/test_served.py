"""``pdserve profile --served``: step logs of real clusters (local Ray, the router, the
tiny chat model) fitted to a cost model; the fits themselves on hand-made samples."""

from __future__ import annotations

import json

import pytest
import yaml

from pdserve.cluster.cli import main
from pdserve.loadgen.workloads import WorkloadSpec, make_workload, model_info
from pdserve.planner.fitted import FittedCost
from pdserve.planner.served import fit_served
from tests.cluster.helpers import make_chat_model, small_cluster_config
from tests.cluster.test_disagg import disagg_config


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _rows(shapes, cost):
    return [[*s, cost(*s)] for s in shapes]


def test_fit_served_recovers_each_role():
    prefill = lambda t, sq, b, c: 0.01 + 2e-3 * t + 1e-6 * sq  # noqa: E731
    decode = lambda t, sq, b, c: 0.03 + 1e-3 * b + 2e-6 * c  # noqa: E731
    mixed = lambda t, sq, b, c: 0.02 + 3e-3 * t + 2e-6 * sq + 4e-3 * b + 1e-5 * c  # noqa: E731
    prompts = [(t, t * t + 7 * t, 0, 0) for t in (16, 100, 256, 512)]
    decodes = [(0, 0, b, b * c) for b in (1, 4, 9) for c in (40, 300)]
    both = [(t, sq, b, c + 5 * t) for t, sq, _, _ in prompts for _, _, b, c in decodes[:3]]
    samples = {
        ("prefill", 1): _rows(prompts, prefill) + _rows(both, prefill),  # steps with decodes
        ("decode", 1): _rows(decodes, decode),  # are left out of the prefill fit
        ("colocated", 2): _rows(prompts + decodes + both, mixed),
    }
    p, d, m = fit_served(samples)
    assert p[1] == pytest.approx([0.01, 2e-3, 1e-6], rel=1e-6)
    assert d[1] == pytest.approx([0.03, 1e-3, 2e-6], rel=1e-6)
    assert m[2] == pytest.approx([0.02, 3e-3, 2e-6, 4e-3, 1e-5], rel=1e-6)
    assert 1 not in m
    # a co-located fit alone gives both phases: its terms with the other phase absent
    assert p[2] == pytest.approx([0.02, 3e-3, 2e-6]) and d[2] == pytest.approx([0.02, 4e-3, 1e-5])
    cost = FittedCost(p, d, [0.0, 1e-9], 1000, {1: 64, 2: 64}, mixed=m)
    assert cost.mixed_s(100, 1e4, 3, 600, tp=2) == pytest.approx(mixed(100, 1e4, 3, 600))
    assert cost.mixed_s(100, 1e4, 3, 600, tp=1) == pytest.approx(
        prefill(100, 1e4, 0, 0) + decode(0, 0, 3, 600)
    )


def test_fit_served_names_what_is_missing():
    rows = [[0, 0, 2, 100, 0.05]] * 10  # one shape only
    with pytest.raises(ValueError, match="decode tp 1: 1 distinct step shapes served, 3 needed"):
        fit_served({("decode", 1): rows})


def test_profile_served_colocated_and_disaggregated(chat_model, tmp_path, capsys):
    paths = []
    for name, config in (
        ("colocated", small_cluster_config(chat_model)),
        ("disagg", disagg_config(chat_model, "gloo", True, 1)),
    ):
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(config))
    out = tmp_path / "profile.json"
    argv = ["profile", "--served", *map(str, paths), "--workload", "longprompt", "--rate", "8"]
    argv += ["--duration", "2", "--long-prompt-mean", "150", "--long-output-mean", "6"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "profile: 16 requests (0 failed)" in printed and "served, tp 1: prefill" in printed

    cost = FittedCost.load(out)
    assert set(cost.prefill) == set(cost.decode) == set(cost.mixed) == {1}
    assert cost.decode_s(4, 400) > 0 and cost.prefill_s(100, 1e4) > 0
    assert cost.kv_capacity_tokens(1) == 512 * 16
    # Every step of the calibration requests is logged once, with what it computed: the
    # prompts' tokens in prefill steps, one decode per request per token after the first.
    spec = WorkloadSpec("longprompt", seed=1, long_prompt_mean=150, long_output_mean=6)
    tokenizer, max_len = model_info(chat_model)
    reqs = make_workload(spec, tokenizer, 16, 8, max_len)
    prompt_tokens = sum(len(r[1]) for r in reqs)
    decodes = sum(r.output_len - 1 for r in reqs)
    meta = json.loads(out.read_text())["meta"]
    assert meta["model"] == chat_model and meta["dtype"] == "float32"  # what plan reads
    points = meta["points"]
    for role in ("colocated tp 1", "prefill tp 1"):
        assert sum(row[0] for row in points[role]) == prompt_tokens
    for role in ("colocated tp 1", "decode tp 1"):
        assert sum(row[2] for row in points[role]) == decodes
    assert all(row[4] > 0 for rows in points.values() for row in rows)
