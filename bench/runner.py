"""``pdserve bench``: launch a cluster, replay a workload through the router at each
rate, measure SLO attainment, find the goodput, write every request to a JSON file.

    pdserve bench configs/local-disagg.yaml --workload sharegpt --rates 0.5,1,2 [--search]
        --duration 60 --slo-ttft-ms 1000 --slo-tpot-ms 150 --out results.json

Each rate sends ``round(rate * duration)`` requests (the same requests at every rate,
only the arrival times scale) open-loop: a request is sent at its arrival time whether
or not the earlier ones finished. Requests ask for ``output_len`` tokens with
``ignore_eos`` and greedy sampling, so their lengths are the workload's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.metrics import SLO, GoodputResult, Record, search_goodput, summarize
from bench.workloads import WORKLOADS, Request, WorkloadSpec, make_workload, model_info


def devices(config) -> int:
    """Devices the cluster's pools use: GPUs when they have any, else one per rank."""
    gpus = sum(
        p.instances * p.tensor_parallel * p.resources.num_gpus for p in config.pools().values()
    )
    if gpus:
        return math.ceil(gpus)
    return sum(p.instances * p.tensor_parallel for p in config.pools().values())


async def _one(client, index: int, req: Request, start: float, timeout_s: float | None):
    import grpc

    sent = time.monotonic() - start
    rec = Record(
        index, sent, len(req.prompt_token_ids), req.output_len, lag_ms=(sent - req.arrival_s) * 1e3
    )
    try:
        done = await client.acomplete(
            prompt_token_ids=req.prompt_token_ids,
            max_tokens=req.output_len,
            temperature=0.0,
            ignore_eos=True,
            timeout=timeout_s,
        )
    except grpc.RpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
        return rec
    rec.finish_reason, rec.completion_tokens = done.finish_reason, done.completion_tokens
    t = done.timings
    if t is None:
        rec.error = "the stream ended without a final message"
        return rec
    rec.ttft_ms, rec.tpot_ms, rec.e2e_ms, rec.queue_ms = t.ttft_ms, t.tpot_ms, t.e2e_ms, t.queue_ms
    rec.instances, rec.kv_bytes, rec.transfer_ms = list(t.instances), t.kv_bytes, t.transfer_ms
    rec.phases = {k: v for k, v in t.phases.items() if k != "tokens"}
    return rec


async def replay(
    client, requests: list[Request], label: str = "", timeout_s: float | None = None
) -> list[Record]:
    """Send each request at its arrival time; the records in request order."""
    start = time.monotonic()
    tasks: list[asyncio.Task] = []

    def progress(end: str = "") -> None:
        if label:
            done = sum(t.done() for t in tasks)
            sys.stderr.write(
                f"\r{label}: sent {len(tasks)}/{len(requests)}, done {done}, "
                f"{time.monotonic() - start:.1f} s{end}"
            )
            sys.stderr.flush()

    async def ticker():  # a line redrawn each second on a terminal; else only the last
        while sys.stderr.isatty():
            progress()
            await asyncio.sleep(1.0)

    tick = asyncio.create_task(ticker())
    try:
        for i, req in enumerate(requests):
            delay = start + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, i, req, start, timeout_s)))
        records = await asyncio.gather(*tasks)
    finally:
        tick.cancel()
        await client.aclose()
    progress("\n")
    return list(records)


def describe(rate: float, s: dict) -> str:
    def ms(key):
        return "-" if s[key] is None else f"{s[key]:.0f}"

    return (
        f"rate {rate:g}/s: {s['requests']} requests ({s['errors']} failed), "
        f"attainment {s['attainment']:.2f} "
        f"(TTFT {s['attainment_ttft']:.2f}, TPOT {s['attainment_tpot']:.2f}), "
        f"TTFT p50/p90/p99 {ms('p50_ttft_ms')}/{ms('p90_ttft_ms')}/{ms('p99_ttft_ms')} ms, "
        f"TPOT p50/p90/p99 {ms('p50_tpot_ms')}/{ms('p90_tpot_ms')}/{ms('p99_tpot_ms')} ms, "
        f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} tok/s"
    )


def run_bench(
    config,
    spec: WorkloadSpec,
    rates: list[float],
    duration_s: float,
    slo: SLO,
    *,
    search: bool = False,
    out: str | Path | None = None,
    warmup: int = 2,
    max_runs: int = 12,
    timeout_s: float | None = None,
    overrides: list[str] = (),
    log=print,
) -> dict:
    """Launch ``config`` (a path, dict or ClusterConfig), sweep or search the rate, and
    return (and write to ``out``, after every rate) the results."""
    from cluster.config_loader import load_config
    from cluster.launcher import launch

    source = str(config) if isinstance(config, str | Path) else None
    config = load_config(config, overrides)
    tokenizer, max_len = model_info(config.model)
    n_devices = devices(config)
    results = {
        "config": source,
        "overrides": list(overrides),
        "cluster": config.to_dict(),
        "workload": asdict(spec),
        "duration_s": duration_s,
        "slo": asdict(slo),
        "devices": n_devices,
        "runs": [],
        "goodput": None,
    }

    def save() -> None:
        if out:
            Path(out).write_text(json.dumps(results, indent=1))

    started = time.monotonic()
    cluster = launch(config)
    log(f"bench: cluster up at {cluster.address} in {time.monotonic() - started:.1f} s")
    client = cluster.client()
    try:
        if warmup:
            reqs = make_workload(spec, tokenizer, warmup, math.inf, max_len)
            asyncio.run(replay(client, reqs, timeout_s=timeout_s))

        def run(rate: float) -> list[Record]:
            n = max(1, round(rate * duration_s))
            reqs = make_workload(spec, tokenizer, n, rate, max_len)
            return asyncio.run(replay(client, reqs, f"rate {rate:g}/s", timeout_s))

        def on_rate(rate: float, records: list[Record]) -> None:
            summary = summarize(records, slo)
            log(describe(rate, summary))
            results["runs"].append(
                {"rate": rate, "summary": summary, "records": [r.to_dict() for r in records]}
            )
            save()

        result = search_goodput(run, slo, rates, search=search, max_runs=max_runs, on_rate=on_rate)
    finally:
        client.close()
        cluster.shutdown(drain=False)
    results["goodput"] = goodput_dict(result, n_devices)
    save()
    log(describe_goodput(result, slo, n_devices))
    return results


def goodput_dict(result: GoodputResult, n_devices: int) -> dict:
    return {
        "goodput": result.goodput,
        "per_device": result.goodput / n_devices,
        "met": result.met,
        "lowest_failing": result.lowest_failing,
        "attainment": [[rate, a] for rate, a in result.attainment.items()],
    }


def describe_goodput(result: GoodputResult, slo: SLO, n_devices: int) -> str:
    target = f"{slo.attainment:.0%} within TTFT {slo.ttft_ms:g} ms and TPOT {slo.tpot_ms:g} ms"
    if not result.met:
        lowest = min(result.attainment, default=0)
        return f"goodput: no rate measured (lowest {lowest:g}/s) met {target}"
    above = (
        f", {result.lowest_failing:g}/s did not"
        if result.lowest_failing is not None
        else " (the highest rate measured)"
    )
    return (
        f"goodput: {result.goodput:.3g} req/s ({result.goodput / n_devices:.3g} per device, "
        f"{n_devices} devices) met {target}{above}"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML file (configs/local-disagg.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    p.add_argument("--workload", default="sharegpt", choices=WORKLOADS)
    p.add_argument("--trace", help="JSONL trace file (--workload trace)")
    p.add_argument("--rates", default="1", help="comma-separated request rates (per second)")
    p.add_argument("--search", action="store_true", help="then search the goodput by bisection")
    p.add_argument("--max-runs", type=int, default=12, help="rates measured at most (--search)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--slo-ttft-ms", type=float, help="default: the config's slo.ttft_ms")
    p.add_argument("--slo-tpot-ms", type=float, help="default: the config's slo.tpot_ms")
    p.add_argument("--attainment", type=float, help="default: the config's slo.attainment")
    p.add_argument("--out", default="bench-results.json", help="results JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape; 1 is Poisson")
    p.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt lengths")
    p.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    p.add_argument("--max-prompt-tokens", type=int, help="cap prompt lengths")
    p.add_argument("--max-output-tokens", type=int, help="cap output lengths")
    p.add_argument("--long-prompt-mean", type=int, default=1500, help="--workload longprompt")
    p.add_argument("--long-output-mean", type=int, default=90, help="--workload longprompt")
    p.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    p.add_argument("--timeout-s", type=float, help="per-request deadline")


def main(args: argparse.Namespace) -> int:
    from cluster.config_loader import ConfigError, load_config

    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
        if not rates or min(rates) <= 0:
            raise ValueError("--rates: give positive rates, e.g. 0.5,1,2")
        config = load_config(args.config, args.set or [])
        spec = WorkloadSpec(
            args.workload,
            seed=args.seed,
            burstiness=args.burstiness,
            prompt_scale=args.prompt_scale,
            output_scale=args.output_scale,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
            long_prompt_mean=args.long_prompt_mean,
            long_output_mean=args.long_output_mean,
            trace=args.trace,
        )
    except (ValueError, ConfigError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    slo = SLO(
        args.slo_ttft_ms or config.slo.ttft_ms,
        args.slo_tpot_ms or config.slo.tpot_ms,
        args.attainment or config.slo.attainment,
    )
    run_bench(
        args.config,
        spec,
        rates,
        args.duration,
        slo,
        search=args.search,
        out=args.out,
        warmup=args.warmup,
        max_runs=args.max_runs,
        timeout_s=args.timeout_s,
        overrides=args.set or [],
        log=lambda line: print(line, flush=True),
    )
    print(f"bench: results in {args.out}", flush=True)
    return 0
