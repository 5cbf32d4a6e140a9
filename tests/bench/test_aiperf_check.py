"""The AIPerf cross-check's parts that need no cluster: histograms from a real
prometheus_client exposition (scrape deltas, bucket-interpolated quantiles), the
AIPerf input file, the reading of AIPerf's export files (in the layout AIPerf 0.13
writes them), the comparison rows, and the refusal when AIPerf is not installed.
``python -m pdserve.bench.aiperf_check`` runs the whole of it against a cluster."""

from __future__ import annotations

import json
import math
import sys

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.bench import aiperf_check, aiperf_run
from pdserve.bench.aiperf_check import halves
from pdserve.bench.aiperf_report import agreement_rows, histogram_rows, paired_ratios
from pdserve.bench.prom_histograms import Histogram as PromHistogram
from pdserve.bench.prom_histograms import bucket_width, delta, histograms, quantile
from pdserve.engine.tokenizer import Tokenizer
from pdserve.loadgen.metrics import SLO, Record, percentile
from pdserve.loadgen.workloads import Request
from tests.tiny_models import save_byte_tokenizer

TTFT = "pdserve:time_to_first_token_seconds"
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5)


def exposition(values: dict[str, list[float]]) -> str:
    """The text a server with one TTFT histogram, two label sets, would serve."""
    registry = CollectorRegistry()
    h = Histogram(TTFT, "ttft", ("model_name",), registry=registry, buckets=BUCKETS)
    for model, vs in values.items():
        for v in vs:
            h.labels(model).observe(v)
    return generate_latest(registry).decode()


def test_histograms_sum_label_sets_and_delta_keeps_what_a_run_added():
    before = histograms(exposition({"a": [0.05, 0.3], "b": [3.0]}))
    after = histograms(exposition({"a": [0.05, 0.3, 0.2, 0.7], "b": [3.0, 0.05]}))
    assert set(before) == {TTFT}  # the counters and gauges of a page are not histograms
    h = before[TTFT]
    assert h.bounds == (*BUCKETS, math.inf)
    assert h.cumulative == (1, 1, 2, 2, 2, 3) and h.count == 3
    assert h.total == pytest.approx(3.35)
    run = delta(after, before)[TTFT]
    assert run.cumulative == (1, 2, 2, 3, 3, 3)  # 0.05, 0.2, 0.7
    assert run.total == pytest.approx(0.95)
    assert delta(after, {})[TTFT] == after[TTFT]
    with pytest.raises(ValueError, match="went down"):
        delta(before, after)


def test_quantile_interpolates_within_the_bucket_as_prometheus_does():
    h = delta(histograms(exposition({"a": [0.05] * 2 + [0.2] * 6 + [0.4] * 2})), {})[TTFT]
    # rank 5 of 10 falls in (0.1, 0.25], which holds ranks 3..8: 0.1 + 0.15 * 3/6
    assert quantile(h, 0.5) == pytest.approx(0.175)
    assert quantile(h, 0.1) == pytest.approx(0.05)  # rank 1 of the first bucket's 2, from 0
    assert quantile(h, 0.9) == pytest.approx(0.375)  # (0.25, 0.5]: ranks 9..10
    high = delta(histograms(exposition({"a": [9.0] * 3})), {})[TTFT]
    assert quantile(high, 0.5) == 2.5  # past the last finite bound: that bound
    assert quantile(PromHistogram(h.bounds, (0.0,) * len(h.bounds), 0.0), 0.5) is None
    with pytest.raises(ValueError, match="0..1"):
        quantile(h, 50)


def test_quantile_of_many_values_is_within_a_bucket_of_the_exact_percentile():
    values = [(i * 7919 % 1000) / 400 for i in range(1000)]  # spread over 0..2.5
    h = delta(histograms(exposition({"a": values})), {})[TTFT]
    for q in (50, 90, 99):
        exact = percentile(values, q)
        assert abs(quantile(h, q / 100) - exact) <= bucket_width(h, exact)


def test_bucket_width():
    h = histograms(exposition({"a": [0.2]}))[TTFT]
    assert bucket_width(h, 0.05) == 0.1
    assert bucket_width(h, 0.25) == pytest.approx(0.15)  # le is inclusive
    assert bucket_width(h, 0.3) == 0.25
    assert bucket_width(h, 3.0) == math.inf


def test_inputs_replay_the_same_token_ids_lengths_and_arrival_times(tmp_path):
    save_byte_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_folder(tmp_path, (2,))
    requests = [Request(0.0, [72, 105], 5), Request(1.25, [111, 107, 33], 9)]
    aiperf_run.write_inputs(tmp_path / "in.jsonl", requests, tokenizer)
    lines = [json.loads(line) for line in (tmp_path / "in.jsonl").read_text().splitlines()]
    assert [line["timestamp"] for line in lines] == [0.0, 1250.0]
    assert [line["output_length"] for line in lines] == [5, 9]
    assert lines[1]["text"] == "ok!"
    assert lines[1]["extra"] == {
        "prompt": [111, 107, 33],
        "max_tokens": 9,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    cmd = aiperf_run.command("aiperf", "http://127.0.0.1:1", "m", tmp_path, tmp_path / "in.jsonl",
                             tmp_path / "out", SLO(500, 40))  # fmt: skip
    assert cmd[cmd.index("--goodput") + 1] == "time_to_first_token:500 inter_token_latency:40"
    assert {"--fixed-schedule", "--streaming", "--use-server-token-count"} <= set(cmd)


def write_exports(folder, with_server: bool = True) -> None:
    """Export files as AIPerf 0.13 writes them (fields this reader does not use
    left out)."""
    folder.mkdir()
    stat = lambda p50, p90, p99: {"unit": "ms", "avg": p50, "p50": p50, "p90": p90, "p99": p99}  # noqa: E731
    summary = {
        "aiperf_version": "0.13.0",
        "request_count": {"unit": "requests", "avg": 3.0},
        "good_request_count": {"unit": "requests", "avg": 2.0},
        "time_to_first_token": stat(100.0, 180.0, 199.0),
        "inter_token_latency": stat(20.0, 30.0, 31.0),
        "inter_chunk_latency": stat(19.0, 35.0, 60.0),
    }
    (folder / "profile_export_aiperf.json").write_text(json.dumps(summary))
    records = [  # in the order they finished; sent in the order of credit_issued_ns
        {"metadata": {"credit_issued_ns": sent},
         "metrics": {"time_to_first_token": {"value": t, "unit": "ms"},
                     "inter_chunk_latency": {"value": gaps, "unit": "ms"}}
                    | ({"inter_token_latency": {"value": i, "unit": "ms"}} if i else {})}
        for sent, t, i, gaps in ((2, 200.0, 30.0, [35.0]), (1, 100.0, 20.0, [19.0, 21.0]),
                                 (3, 50.0, None, []))
    ]  # fmt: skip
    (folder / "profile_export.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if with_server:
        stats = {"count": 3, "p50_estimate": 0.11, "p90_estimate": 0.2, "p99_estimate": 0.24}
        server = {"metrics": {TTFT: {"type": "histogram", "series": [{"stats": stats}]}}}
        (folder / "server_metrics_export.json").write_text(json.dumps(server))


def test_read_results_takes_the_summary_every_request_and_the_server_estimates(tmp_path):
    write_exports(tmp_path / "run")
    r = aiperf_run.read_results(tmp_path / "run", (TTFT, "pdserve:absent_seconds"))
    assert (r.version, r.requests, r.good, r.errors) == ("0.13.0", 3, 2, 0)
    assert r.client["time_to_first_token"] == {50: 100.0, 90: 180.0, 99: 199.0}
    assert [q["time_to_first_token"] for q in r.per_request] == [100.0, 200.0, 50.0]
    assert [q["inter_token_latency"] for q in r.per_request] == [20.0, 30.0, None]
    assert aiperf_run.pooled([r, r], "inter_chunk_latency") == [19.0, 21.0, 35.0] * 2
    assert aiperf_run.pooled([r], "inter_token_latency") == [20.0, 30.0]
    assert r.server == {TTFT: {50: 0.11, 90: 0.2, 99: 0.24}}
    write_exports(tmp_path / "bare", with_server=False)
    assert aiperf_run.read_results(tmp_path / "bare", (TTFT,)).server == {}


def test_paired_ratios_match_each_request_with_itself():
    def record(ttft: float, tpot: float, reason: str = "length") -> Record:
        return Record(0, 0.0, 8, 4, 4, ttft, tpot, 1.0, finish_reason=reason)

    bench = {0: record(100.0, 10.0), 1: record(100.0, 30.0), 2: record(25.0, 5.0),
             3: record(50.0, 20.0), 4: record(1.0, 1.0, reason="abort")}  # fmt: skip
    aiperf = {
        0: {"time_to_first_token": 100.0, "inter_token_latency": 20.0},
        1: {"time_to_first_token": 200.0, "inter_token_latency": 30.0},
        2: {"time_to_first_token": 50.0, "inter_token_latency": None},  # a one-token answer
        4: {"time_to_first_token": 9.0, "inter_token_latency": 9.0},  # bench's failed
    }
    paired = paired_ratios(bench, aiperf)
    assert paired["TTFT"] == pytest.approx(2.0)  # of 1, 2, 2 (request 3: AIPerf has none)
    assert paired["ITL"] == pytest.approx(1.5)  # of 2, 1
    assert paired_ratios({}, {}) == {"TTFT": None, "ITL": None}


def test_halves_alternate_and_swap_so_two_rounds_send_every_request_once_each():
    assert halves(5, 0) == ([0, 2, 4], [1, 3])
    assert halves(5, 1) == ([1, 3], [0, 2, 4])


def test_running_sees_the_measured_phase_start_and_the_exit_status(tmp_path):
    script = (
        "import sys, time\n"
        "print('10:00:00 INFO     Starting AIPerf System', flush=True)\n"
        "print('10:00:01 NOTICE   Phase profiling (profiling) started | target: 2', flush=True)\n"
        "print('10:00:01 WARNING  Token usage ... no prompt-cache read tokens', flush=True)\n"
        "time.sleep(0.2)\n"
        "print('10:00:02 ERROR    it broke', flush=True)\n"
        "sys.exit(3)\n"
    )
    shown: list[str] = []
    running = aiperf_run.Running([sys.executable, "-c", script], tmp_path / "a.log", shown.append)
    assert running.profiling.wait(30.0)
    assert running.wait() == 3 and running.exited()
    assert [line.split()[2] for line in shown] == ["NOTICE", "ERROR"]  # not INFO, not the advice
    assert "Starting AIPerf System" in (tmp_path / "a.log").read_text()


def test_rows_pass_within_the_tolerance_and_within_a_bucket(tmp_path):
    bench = {f"p{q}_{k}_ms": v for k, v in (("ttft", 100.0), ("tpot", 20.0)) for q in (50, 90, 99)}
    pooled = {"time_to_first_token": {50: 109.0, 90: 111.0, 99: 91.0},
              "inter_token_latency": {50: 20.0, 90: 17.0, 99: None}}  # fmt: skip
    rows = agreement_rows(bench, pooled, 0.1)
    assert [r["ok"] for r in rows] == [True, False, True, True, False, False]
    assert rows[0]["ratio"] == pytest.approx(1.09)
    write_exports(tmp_path / "run")
    ai = aiperf_run.read_results(tmp_path / "run", (TTFT,))
    window = {TTFT: delta(histograms(exposition({"a": [0.09, 0.2, 0.3]})), {})[TTFT]}
    rows = {r["what"]: r for r in histogram_rows(window, ai)}
    assert set(rows) == {"TTFT count", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms"}
    assert rows["TTFT count"]["ok"] and rows["TTFT count"]["server"] == 3
    window4 = {TTFT: delta(histograms(exposition({"a": [0.09, 0.2, 0.3, 0.3]})), {})[TTFT]}
    assert not histogram_rows(window4, ai)[0]["ok"]  # 4 counted, AIPerf sent 3
    # p50: client 100 in (0, 100], /metrics 175 and AIPerf's 110 in (100, 250]: width 150
    assert rows["TTFT p50 ms"]["width"] == pytest.approx(150.0) and rows["TTFT p50 ms"]["ok"]
    # p90: /metrics 425 (rank 2.7 in (250, 500]) is 245 from the client's 180: within 250
    assert rows["TTFT p90 ms"]["server"] == pytest.approx(250 + 250 * 0.7)
    assert rows["TTFT p90 ms"]["width"] == pytest.approx(250.0) and rows["TTFT p90 ms"]["ok"]
    # p99: /metrics 492.5 is 293.5 from the client's 199: past 250
    assert rows["TTFT p99 ms"]["server"] == pytest.approx(250 + 250 * 0.97)
    assert not rows["TTFT p99 ms"]["ok"]
    assert histogram_rows({}, ai) == []  # a server without the histograms: nothing compared


def test_without_aiperf_it_says_how_to_install_it_before_starting_anything(capsys):
    assert aiperf_check.main(["--aiperf", "/nonexistent/aiperf"]) == 2
    err = capsys.readouterr().err
    assert "'/nonexistent/aiperf': no such executable" in err and "pip install aiperf" in err
    assert aiperf_run.find(sys.executable) == sys.executable
