"""``pdserve bench`` end to end: a real local Ray cluster of the tiny chat model, a
few ShareGPT requests (cut short) per rate through the router, results on disk."""

from __future__ import annotations

import json

import yaml

from pdserve.cluster.cli import main
from pdserve.loadgen.metrics import SLO
from pdserve.loadgen.runner import run_bench
from pdserve.loadgen.workloads import WorkloadSpec
from tests.cluster.helpers import small_cluster_config
from tests.cluster.test_disagg import disagg_config

SHORT = ["--max-prompt-tokens", "48", "--max-output-tokens", "6", "--warmup", "1"]


def test_cli_disaggregated_search_where_no_rate_meets_the_slo(chat_model, tmp_path, capsys):
    config = tmp_path / "disagg.yaml"
    config.write_text(yaml.safe_dump(disagg_config(chat_model, "gloo", True, 1)))
    out = tmp_path / "results.json"
    argv = ["bench", str(config), "--rates", "2,4", "--search", "--max-runs", "3"]
    argv += ["--duration", "1", "--slo-ttft-ms", "0.001", "--out", str(out), *SHORT]
    assert main(argv) == 0
    assert "goodput: no rate measured (lowest 1/s) met 90% within TTFT 0.001 ms" in (
        capsys.readouterr().out
    )
    results = json.loads(out.read_text())
    # 2 and 4 fail, so the search halves once: 1 (max-runs 3)
    assert [run["rate"] for run in results["runs"]] == [2, 4, 1]
    assert [len(run["records"]) for run in results["runs"]] == [2, 4, 1]
    assert results["goodput"] == {
        "goodput": 0.0,
        "per_device": 0.0,
        "met": False,
        "lowest_failing": 1.0,
        "attainment": [[1.0, 0.0], [2.0, 0.0], [4.0, 0.0]],
    }
    assert results["devices"] == 2 and results["slo"]["tpot_ms"] == 150  # from the config
    for run in results["runs"]:
        assert run["summary"]["errors"] == 0 and run["summary"]["attainment_tpot"] == 1.0
        for r in run["records"]:
            assert r["error"] is None and r["finish_reason"] == "length"
            assert r["completion_tokens"] == r["output_len"] <= 6 and r["prompt_tokens"] <= 48
            assert r["instances"] == ["prefill-0", "decode-0"] and r["kv_bytes"] > 0
            assert 0 < r["ttft_ms"] <= r["e2e_ms"]
            assert r["phases"]["prefill_start"] <= r["phases"]["decode_start"]


def test_sweep_colocated(chat_model, tmp_path):
    out = tmp_path / "results.json"
    spec = WorkloadSpec("humaneval", max_prompt_tokens=48, max_output_tokens=6)
    results = run_bench(
        small_cluster_config(chat_model),
        spec,
        [1, 3],
        2.0,
        SLO(ttft_ms=60_000, tpot_ms=60_000),
        out=out,
        warmup=0,
        log=lambda line: None,
    )
    assert json.loads(out.read_text()) == results
    assert results["goodput"]["goodput"] == 3 and results["goodput"]["per_device"] == 1.5
    sent = {run["rate"]: [r["sent_s"] for r in run["records"]] for run in results["runs"]}
    assert len(sent[1]) == 2 and len(sent[3]) == 6
    assert sent[3][-1] < sent[1][-1]  # the same requests, sent sooner at the higher rate
    for run in results["runs"]:
        s = run["summary"]
        assert s["attainment"] == 1.0 and s["completed"] == s["requests"]
        assert s["p50_ttft_ms"] <= s["p99_ttft_ms"] and s["request_throughput"] > 0


def test_cli_refuses_bad_arguments_before_launching(chat_model, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(small_cluster_config(chat_model)))
    assert main(["bench", str(config), "--rates", "1,0"]) == 2
    assert main(["bench", str(config), "--workload", "trace"]) == 2
    assert main(["bench", str(config), "--set", "colocated.instances=-1"]) == 2
    err = capsys.readouterr().err
    assert "--rates: give positive rates" in err and "give the trace file" in err
    assert "colocated.instances: -1 is not allowed" in err
