"""``pdserve bench --workload mooncake`` end to end: a real local Ray cluster of the tiny
chat model (disaggregated, prefix caching on) replays a few seconds of the shipped
Mooncake trace, scaled; the window and scales are printed and stored with the result,
and the trace's shared first block reaches the prefix cache."""

from __future__ import annotations

import json

import pytest
import yaml

from pdserve.cluster.cli import main
from pdserve.loadgen.trace_replay import trace_window
from pdserve.loadgen.workloads import WorkloadSpec, make_workload, model_info
from tests.cluster.test_disagg import disagg_config
from tests.loadgen.test_trace_formats import MOONCAKE

WINDOW = ["--start", "900", "--duration", "3", "--time-scale", "2", "--token-scale", "0.03125"]


@pytest.mark.timeout(240)
def test_cli_bench_replays_a_mooncake_window(chat_model, tmp_path, capsys):
    config = tmp_path / "disagg.yaml"
    config.write_text(yaml.safe_dump(disagg_config(chat_model, "gloo", True, 1)))
    out = tmp_path / "results.json"
    argv = ["bench", str(config), "--workload", "mooncake", "--trace", str(MOONCAKE), *WINDOW]
    argv += ["--max-output-tokens", "4", "--warmup", "1", "--slo-ttft-ms", "60000"]
    assert main([*argv, "--out", str(out)]) == 0
    spec = WorkloadSpec(
        "mooncake",
        trace=str(MOONCAKE),
        trace_start_s=900,
        trace_duration_s=3,
        time_scale=2,
        token_scale=0.03125,
        max_output_tokens=4,
    )
    window = trace_window(spec)
    printed = capsys.readouterr().out
    line = f"bench: replay of {window.describe()}"
    assert printed.count(line) == 2  # before the run and with the goodput line
    assert "window 900-903 s" in line and "time scale 2 (gaps x2), token scale 0.03125" in line
    results = json.loads(out.read_text())
    assert results["trace_replay"] == json.loads(json.dumps(window.to_dict()))
    assert results["workload"]["time_scale"] == 2 and results["workload"]["token_scale"] == 0.03125
    [run] = results["runs"]  # one pace: the window's offered rate
    assert run["rate"] == pytest.approx(window.offered_rate)
    tokenizer, max_len = model_info(chat_model)
    sent = make_workload(spec, tokenizer, 0, 1.0, max_len)
    records = run["records"]
    assert len(records) == len(window.rows) == len(sent) > 5
    assert sorted(r["prompt_tokens"] for r in records) == sorted(
        len(r.prompt_token_ids) for r in sent
    )
    assert all(r["error"] is None and r["completion_tokens"] == r["output_len"] for r in records)
    # the arrivals' spread is the trace's, stretched twice (generous: the client may lag)
    spread = max(r["sent_s"] for r in records) - min(r["sent_s"] for r in records)
    assert spread >= sent[-1].arrival_s - sent[0].arrival_s - 0.5
    # every prompt starts with hash id 0's block (16 tokens): later ones find it cached
    assert run["summary"]["hit_rate"] > 0
