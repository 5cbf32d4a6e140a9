"""NVIDIA AIPerf (``pip install aiperf``, its own virtual environment) driven on a
``pdserve bench`` workload, and its results read back.

AIPerf replays requests ``loadgen.workloads.make_workload`` drew: a ``single_turn``
JSONL file (``write_inputs``), one line a request, whose ``timestamp`` (ms) is the
request's arrival time (replayed with ``--fixed-schedule`` from 0, not from the first
timestamp: ``--fixed-schedule-start-offset 0``, so that a part of a workload keeps its
place in time) and whose ``extra`` fields replace the body's: ``prompt`` = the token ids,
``max_tokens`` = the output length, ``temperature`` 0 and ``ignore_eos``, as
``loadgen/endpoint.py`` sends them. ``text`` (the ids decoded) is only there because
the format asks for one modality; ``--use-server-token-count`` makes AIPerf count
tokens from the server's ``usage`` instead of tokenizing it.

``Running`` is one ``aiperf profile`` in progress: its ``profiling`` event is set when
AIPerf logs that its measured phase started, the zero of its schedule.

What is read back (``read_results``): AIPerf's client-side percentiles (ms) of
``time_to_first_token``, ``inter_token_latency`` (per request: (latency - TTFT) /
(output tokens - 1), the quantity ``pdserve bench`` calls TPOT) and
``inter_chunk_latency`` (every gap between two streamed chunks), its goodput count,
and from ``server_metrics_export.json`` its own bucket estimates (seconds) of the
server's histograms over its run (it scrapes ``{url}/metrics`` by itself).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.loadgen.metrics import SLO
from pdserve.loadgen.workloads import Request

PERCENTILES = (50, 90, 99)
CLIENT_METRICS = ("time_to_first_token", "inter_token_latency", "inter_chunk_latency")
# an AIPerf log line worth showing while it runs (the rest goes to its log file): its
# phases, its troubles, but not its advice to turn on prompt-cache reporting (pdserve
# has no prefix cache to report)
SHOWN = re.compile(r"\b(NOTICE|WARNING|ERROR|CRITICAL)\b|Benchmark Duration")
HIDDEN = re.compile(r"prompt-cache")
PROFILING = re.compile(r"Phase profiling \(profiling\) started")
INSTALL = (
    "install it in its own virtual environment: python3 -m venv /work/aiperf-venv && "
    "/work/aiperf-venv/bin/pip install aiperf==0.13.0; then pass "
    "--aiperf /work/aiperf-venv/bin/aiperf"
)


@dataclass
class AiperfResult:
    version: str
    requests: int  # the requests AIPerf counted
    good: int  # of them, those that met both objectives (its --goodput)
    errors: int
    client: dict[str, dict[int, float]]  # metric tag -> percentile -> ms
    # every request in the order AIPerf sent them: metric tag -> ms (inter_chunk_latency:
    # a list of gaps; None where AIPerf has no value, e.g. ITL of a one-token answer)
    per_request: list[dict]
    server: dict[str, dict[int, float]] = field(default_factory=dict)  # histogram -> q -> s


def find(aiperf: str) -> str:
    """The AIPerf executable ``aiperf`` names (a path, or a name on PATH);
    FileNotFoundError saying how to install it when there is none."""
    path = shutil.which(aiperf)
    if path is None:
        raise FileNotFoundError(f"--aiperf {aiperf!r}: no such executable; {INSTALL}")
    return path


def write_inputs(path: Path, requests: list[Request], tokenizer) -> None:
    """The requests as AIPerf's ``single_turn`` JSONL (module docstring)."""
    with open(path, "w") as f:
        for r in requests:
            line = {
                "text": tokenizer.decode(r.prompt_token_ids),
                "timestamp": r.arrival_s * 1e3,
                "output_length": r.output_len,
                "extra": {
                    "prompt": list(r.prompt_token_ids),
                    "max_tokens": r.output_len,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            }
            f.write(json.dumps(line) + "\n")


def command(
    aiperf: str,
    url: str,
    model: str,
    tokenizer_dir: Path,
    inputs: Path,
    out_dir: Path,
    slo: SLO,
    endpoint_type: str = "completions",
) -> list[str]:
    """``aiperf profile`` on the ``endpoint_type`` endpoint (``completions``, ``chat``),
    streaming, replaying ``inputs`` at their timestamps, goodput under ``slo``,
    artifacts into ``out_dir``."""
    goodput = f"time_to_first_token:{slo.ttft_ms:g} inter_token_latency:{slo.tpot_ms:g}"
    return [
        aiperf, "profile",
        "--model", model,
        "--url", url,
        "--endpoint-type", endpoint_type,
        "--streaming",
        "--tokenizer", str(tokenizer_dir),
        "--input-file", str(inputs),
        "--custom-dataset-type", "single-turn",
        "--fixed-schedule",
        "--fixed-schedule-start-offset", "0",
        "--use-server-token-count",
        "--goodput", goodput,
        "--artifact-dir", str(out_dir),
        "--ui", "none",
        "--no-gpu-telemetry",
        "--workers-max", "1",
        "--record-processors", "1",
    ]  # fmt: skip


class Running:
    """AIPerf started on ``cmd``: its output into ``log_path``, the lines that tell
    progress or trouble passed to ``log`` (from a reader thread), ``profiling`` set
    once its measured phase started; ``wait()`` is its exit status."""

    def __init__(self, cmd: list[str], log_path: Path, log: Callable[[str], None]):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.log_path, self.started = log_path, time.monotonic()
        self.profiling = threading.Event()
        self._out = open(log_path, "w")  # noqa: SIM115 (closed by wait)
        self._out.write(" ".join(cmd) + "\n")
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self._reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self._reader.start()

    def _read(self, log: Callable[[str], None]) -> None:
        for line in self._proc.stdout:
            self._out.write(line)
            if PROFILING.search(line):
                self.profiling.set()
            if SHOWN.search(line) and not HIDDEN.search(line):
                log(f"aiperf: {line.rstrip()[:200]}")

    def exited(self) -> bool:
        return self._proc.poll() is not None

    def wait(self) -> int:
        code = self._proc.wait()
        self._reader.join()
        self._out.close()
        return code

    def kill(self) -> None:
        self._proc.kill()
        self.wait()


def read_results(out_dir: Path, histograms: tuple[str, ...]) -> AiperfResult:
    """AIPerf's figures from ``out_dir``: its summary (``profile_export_aiperf.json``),
    every request's values (``profile_export.jsonl``, in the order sent) and, when it
    scraped any, its estimates of the server's ``histograms``
    (``server_metrics_export.json``; a histogram with more than one series is left
    out)."""
    summary = json.loads((out_dir / "profile_export_aiperf.json").read_text())

    def count(tag: str) -> int:
        return int((summary.get(tag) or {}).get("avg") or 0)

    client = {
        tag: {q: summary[tag][f"p{q}"] for q in PERCENTILES}
        for tag in CLIENT_METRICS
        if tag in summary
    }
    with open(out_dir / "profile_export.jsonl") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    lines.sort(key=lambda r: r["metadata"]["credit_issued_ns"])
    per_request = [
        {tag: ((r.get("metrics") or {}).get(tag) or {}).get("value") for tag in CLIENT_METRICS}
        for r in lines
    ]
    result = AiperfResult(
        summary.get("aiperf_version", "?"),
        count("request_count"),
        count("good_request_count"),
        count("error_request_count"),
        client,
        per_request,
    )
    server_path = out_dir / "server_metrics_export.json"
    if server_path.exists():
        metrics = json.loads(server_path.read_text()).get("metrics", {})
        for name in histograms:
            series = (metrics.get(name) or {}).get("series") or []
            if len(series) == 1 and series[0]["stats"].get("count"):
                stats = series[0]["stats"]
                result.server[name] = {q: stats[f"p{q}_estimate"] for q in PERCENTILES}
    return result


def pooled(runs: list[AiperfResult], tag: str) -> list[float]:
    """Every value of ``tag`` over ``runs`` (a request's gaps one by one)."""
    out: list[float] = []
    for run in runs:
        for request in run.per_request:
            v = request[tag]
            out += [] if v is None else v if isinstance(v, list) else [v]
    return out
