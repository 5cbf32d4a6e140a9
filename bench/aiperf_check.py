"""A client nobody here wrote, on the same load: ``pdserve bench``'s measurement and
NVIDIA AIPerf against one cluster at once, and the server's own histograms from
``/metrics`` (docs/benchmarks.md, "Cross-check with AIPerf"; a run is in
docs/performance.md).

    python -m pdserve.bench.aiperf_check [configs/local-disagg.yaml] \\
        --aiperf /work/aiperf-venv/bin/aiperf [--rate 1 --duration 60 --rounds 2 \\
        --max-prompt-tokens 128 --max-output-tokens 32] [--out aiperf-check/]

One cluster (loopback, any free ports), one workload (``round(rate x duration)``
requests and their arrival times). Each round, both clients send it together, each
every other request, from the same moment (when AIPerf logs that it measures):
``pdserve bench``'s replay (``loadgen.replay``: gRPC, the router's times) and AIPerf
over HTTP (``bench/aiperf_run.py``); the next round swaps the halves. So each client
measures every request, always alongside the other: a busy machine slows both alike.
Last, AIPerf alone sends the whole workload, and ``/metrics`` scraped just before and
after (``bench/prom_histograms.py``) holds exactly its requests. Compared, each row
passing or failing (``bench/aiperf_report.py``): AIPerf's pooled TTFT and ITL (bench's
TPOT) p50/p90/p99 against bench's, within ``--tolerance`` (10%); and over AIPerf's
run alone ``pdserve:time_to_first_token_seconds``,
``pdserve:request_time_per_output_token_seconds`` and
``pdserve:inter_token_latency_seconds`` (every gap: AIPerf's ``inter_chunk_latency``)
against its client figures, within a bucket, the TTFT count equal to its requests.

Exit status 0 when every row passes, 1 when one fails, 2 when it cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.bench import aiperf_run
from pdserve.bench.aiperf_report import (
    HISTOGRAM_ROWS,
    agreement_rows,
    agreement_table,
    histogram_rows,
    histogram_table,
    paired_ratios,
)
from pdserve.bench.prom_histograms import delta, histograms, scrape
from pdserve.loadgen.metrics import SLO, Record, percentile, summarize
from pdserve.loadgen.replay import replay
from pdserve.loadgen.runner import QUIET
from pdserve.loadgen.workloads import Request, WorkloadSpec, make_workload, model_info

PERCENTILES = aiperf_run.PERCENTILES
LOOPBACK = ("router.host=127.0.0.1", "router.port=0", "router.http_port=0")


def cpu_path() -> str:
    """The CPU and which of the engine's paths it allows (C kernels, AMX)."""
    from pdserve.engine import native
    from pdserve.engine.amx_gemm import amx_gemm

    model = "unknown CPU"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    kernels = "C kernels" if native.library() is not None else "plain torch (no C kernels)"
    amx = "AMX" if amx_gemm() is not None else "no AMX"
    return f"{model}, {os.cpu_count()} CPUs, {kernels}, {amx}"


STARTUP_S = 300.0  # AIPerf's start (its services, the tokenizer, the dataset) at most


def halves(n: int, i: int) -> tuple[list[int], list[int]]:
    """Round ``i``'s requests: (bench's, AIPerf's), every other one, swapped each round."""
    return [k for k in range(n) if k % 2 == i % 2], [k for k in range(n) if k % 2 != i % 2]


@dataclass
class Rounds:
    """What the rounds left (``measure_together``)."""

    bench: dict[int, Record] = field(default_factory=dict)  # request index -> bench's record
    records: list[Record] = field(default_factory=list)  # bench's, every round
    runs: list[Path] = field(default_factory=list)  # AIPerf's artifact folders, one a round
    sent: list[list[int]] = field(default_factory=list)  # the requests of each AIPerf run
    loads: list[tuple[float, float]] = field(default_factory=list)  # load average, each round
    alone: Path | None = None  # AIPerf's run of the whole workload alone
    window: dict = field(default_factory=dict)  # /metrics histograms over that run


def measure_together(
    config, requests: list[Request], tokenizer, slo: SLO, aiperf: str, args, log
) -> Rounds:
    """On one cluster, ``args.warmup`` requests, then ``args.rounds`` rounds of both
    clients at once (module docstring)."""
    from pdserve.cluster.launcher import launch
    from pdserve.engine.checkpoint import resolve

    out, rounds = Path(args.out), Rounds()
    started = time.monotonic()
    with launch(config) as cluster:
        url = f"http://{cluster.http_address}"
        log(f"aiperf_check: cluster up in {time.monotonic() - started:.1f} s, HTTP at {url}")
        client = cluster.client()
        try:
            # the longest prompts: a long prefill's one-time costs fall here, not on
            # whichever client first meets a long prompt
            longest = sorted(requests, key=lambda r: -len(r.prompt_token_ids))[: args.warmup]
            asyncio.run(replay(client, [Request(0.0, *r[1:]) for r in longest]))
            for i in range(args.rounds):
                mine, theirs = halves(len(requests), i)
                inputs = out / f"aiperf-inputs-{i + 1}.jsonl"
                aiperf_run.write_inputs(inputs, [requests[k] for k in theirs], tokenizer)
                run_dir = out / f"aiperf-{i + 1}"
                cmd = aiperf_run.command(
                    aiperf, url, config.model, resolve(config.model), inputs, run_dir, slo
                )
                load = os.getloadavg()[0]
                log(
                    f"aiperf_check: round {i + 1}/{args.rounds}: AIPerf {len(theirs)} and "
                    f"bench {len(mine)} requests together, {args.rate:g}/s in all "
                    f"(load average {load:.1f})"
                )
                records = both(
                    aiperf_run.Running(cmd, run_dir.with_suffix(".log"), log),
                    client,
                    [requests[k] for k in mine],
                    f"round {i + 1}, bench",
                )
                for k, rec in zip(mine, records, strict=True):
                    rec.index = k
                    rounds.bench[k] = rec
                rounds.records += records
                rounds.runs.append(run_dir)
                rounds.sent.append(theirs)
                rounds.loads.append((load, os.getloadavg()[0]))
            log(
                f"aiperf_check: AIPerf alone, the whole workload ({len(requests)} requests at "
                f"{args.rate:g}/s), for /metrics against its client figures"
            )
            inputs, rounds.alone = out / "aiperf-inputs-alone.jsonl", out / "aiperf-alone"
            aiperf_run.write_inputs(inputs, requests, tokenizer)
            cmd = aiperf_run.command(
                aiperf, url, config.model, resolve(config.model), inputs, rounds.alone, slo
            )
            before = histograms(scrape(f"{url}/metrics"))
            both(aiperf_run.Running(cmd, rounds.alone.with_suffix(".log"), log), client, [], "")
            rounds.window = delta(histograms(scrape(f"{url}/metrics")), before)
        finally:
            client.close()
    return rounds


def both(running: aiperf_run.Running, client, mine: list[Request], label: str) -> list[Record]:
    """Bench's replay of ``mine`` from the moment AIPerf starts measuring, then AIPerf's
    end; RuntimeError when AIPerf fails (it is killed when bench's side fails)."""
    try:
        while not running.profiling.wait(1.0):
            if running.exited() or time.monotonic() - running.started > STARTUP_S:
                raise RuntimeError(f"AIPerf did not start measuring; see {running.log_path}")
        records = asyncio.run(replay(client, mine, label))
    except BaseException:
        running.kill()
        raise
    code = running.wait()
    if code != 0:
        raise RuntimeError(f"aiperf exited with {code}; see {running.log_path}")
    return records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.aiperf_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", default="configs/local-disagg.yaml")
    p.add_argument("--aiperf", default="aiperf", help="the aiperf executable (default: on PATH)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--workload", default="sharegpt", choices=("sharegpt", "humaneval"))
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--rounds", type=int, default=2, help="rounds; the halves swap each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2, help="longest prompts sent first")
    p.add_argument("--slo-ttft-ms", type=float, help="default: the config's slo.ttft_ms")
    p.add_argument("--slo-tpot-ms", type=float, help="default: the config's slo.tpot_ms")
    p.add_argument("--tolerance", type=float, default=0.1, help="AIPerf vs bench, relative")
    p.add_argument("--out", default="aiperf-check", help="folder of AIPerf's files and results")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.rate <= 0 or args.duration <= 0:
        p.error(
            f"--rounds {args.rounds}, --rate {args.rate}, --duration {args.duration}: "
            "each must be positive"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    from pdserve.cluster.config_loader import ConfigError, load_config

    args = parse_args(argv)
    log = lambda line: print(line, flush=True)  # noqa: E731
    try:
        aiperf = aiperf_run.find(args.aiperf)
        config = load_config(args.config, [*LOOPBACK, QUIET, *args.set])
    except (FileNotFoundError, ConfigError) as e:
        print(f"aiperf_check: {e}", file=sys.stderr)
        return 2
    slo = SLO(args.slo_ttft_ms or config.slo.ttft_ms, args.slo_tpot_ms or config.slo.tpot_ms)
    spec = WorkloadSpec(
        args.workload,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_path()
    log(f"aiperf_check: {cpu}")
    tokenizer, max_len = model_info(config.model)
    n = max(1, round(args.rate * args.duration))
    requests = make_workload(spec, tokenizer, n, args.rate, max_len)
    try:
        rounds = measure_together(config, requests, tokenizer, slo, aiperf, args, log)
    except RuntimeError as e:
        print(f"aiperf_check: {e}", file=sys.stderr)
        return 2
    names = tuple(name for _, name, _ in HISTOGRAM_ROWS)
    runs = [aiperf_run.read_results(d, names) for d in rounds.runs]
    bench = summarize(rounds.records, slo)
    pooled = {
        tag: {q: percentile(aiperf_run.pooled(runs, tag), q) for q in PERCENTILES}
        for tag in aiperf_run.CLIENT_METRICS
    }
    agree = agreement_rows(bench, pooled, args.tolerance)
    by_index = {
        k: r
        for run, sent in zip(runs, rounds.sent, strict=True)
        for k, r in zip(sent, run.per_request, strict=False)
    }
    paired = paired_ratios(rounds.bench, by_index)
    alone = aiperf_run.read_results(rounds.alone, names)
    hist = histogram_rows(rounds.window, alone)
    log(
        f"\npdserve bench: {bench['completed']}/{bench['requests']} requests, attainment "
        f"{bench['attainment']:.2f}; AIPerf {runs[0].version}: "
        f"{sum(r.requests for r in runs)} requests ({sum(r.errors for r in runs)} failed), "
        f"{sum(r.good for r in runs)} met TTFT {slo.ttft_ms:g} ms and ITL {slo.tpot_ms:g} ms "
        f"({args.rounds} rounds)\n"
    )
    log(agreement_table(agree, args.tolerance))
    same = ", ".join(f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in paired.items())
    log(f"(the same request, AIPerf / bench, median over requests: {same})")
    loads = ", ".join(f"{a:.1f}-{b:.1f}" for a, b in rounds.loads)
    log(f"(load average over each round, {os.cpu_count()} CPUs: {loads})")
    if hist:
        log(
            f"\n/metrics over AIPerf's run alone against its client figures\n"
            f"{histogram_table(hist)}"
        )
    else:
        log("\n/metrics has no pdserve: histograms: that comparison was not made")
    results = {
        "cpu": cpu,
        "config": args.config,
        "overrides": args.set,
        "workload": asdict(spec),
        "rate": args.rate,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "slo": asdict(slo),
        "bench": bench,
        "aiperf": [asdict(r) for r in runs],
        "aiperf_alone": asdict(alone),
        "aiperf_pooled": pooled,
        "agreement": agree,
        "paired_median_ratio": paired,
        "histograms": hist,
        "loads": rounds.loads,
        "bench_records": [r.to_dict() for r in rounds.records],
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    ok = all(r["ok"] for r in agree + hist)
    log(f"\naiperf_check: {'pass' if ok else 'FAIL'}; results in {out}/results.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
