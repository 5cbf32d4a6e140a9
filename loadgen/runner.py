"""``pdserve bench``: launch a cluster (or use an OpenAI-compatible ``--endpoint``),
replay a workload at each rate, measure SLO attainment, find the goodput, write every
request to a JSON file.

    pdserve bench configs/local-disagg.yaml --workload sharegpt --rates 0.5,1,2 [--search]
        --duration 60 --slo-ttft-ms 1000 --slo-tpot-ms 150 --out results.json

Each rate sends ``round(rate * duration)`` requests (its own sample: the rate is in
the seed, so that no rate finds another's prompts in a prefix cache) open-loop
(``loadgen.replay``); ``multiturn`` starts that many conversations and replays them
closed-loop (``loadgen.chat_replay``), a record per turn. ``azure`` and ``mooncake``
replay a trace window once, at its own pace (``loadgen.trace_replay``): their one
"rate" is the window's offered rate, and its window and scales are printed before the
run and with the goodput line, and stored as ``trace_replay`` in the results. Requests ask for
``output_len`` tokens with ``ignore_eos`` and greedy sampling, so their lengths are
the workload's. ``pdserve compare`` (``loadgen.compare``) runs this for several configs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from pdserve.loadgen.chat_replay import replay_conversations
from pdserve.loadgen.metrics import SLO, GoodputResult, Record, search_goodput, summarize
from pdserve.loadgen.multiturn import first_turns, make_conversations
from pdserve.loadgen.replay import replay
from pdserve.loadgen.workload_args import (
    NO_MULTITURN_ENDPOINT,
    add_workload_arguments,
    parse_common,
)
from pdserve.loadgen.workloads import PRODUCTION_TRACES, WorkloadSpec, make_workload, model_info

# The clusters a benchmark launches log at WARNING: the router's line per request
# (docs/serving.md, "Metrics and logs") would bury the progress; the report has the figures.
QUIET = "logging.level=WARNING"


def devices(config) -> int:
    """Devices the cluster's pools use: GPUs when they have any, else one per rank."""
    gpus = sum(
        p.instances * p.tensor_parallel * p.resources.num_gpus for p in config.pools().values()
    )
    if gpus:
        return math.ceil(gpus)
    return sum(p.instances * p.tensor_parallel for p in config.pools().values())


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


@contextmanager
def serving(config, endpoint: str | None, log=print):
    """A client of the server measured: ``endpoint`` (an OpenAI-compatible URL) when
    given, else a cluster launched from ``config`` and shut down afterwards."""
    if endpoint:
        from pdserve.loadgen.endpoint import EndpointClient

        client = EndpointClient(endpoint)
        log(f"bench: measuring {endpoint} (model {client.model})")
        yield client
        return
    from pdserve.cluster.launcher import launch

    started = time.monotonic()
    cluster = launch(config, [QUIET])
    log(f"bench: cluster up at {cluster.address} in {time.monotonic() - started:.1f} s")
    client = cluster.client()
    try:
        yield client
    finally:
        client.close()
        cluster.shutdown(drain=False)


def measure(
    client,
    model: str,
    spec: WorkloadSpec,
    rates: list[float],
    duration_s: float,
    slo: SLO,
    *,
    search: bool = False,
    warmup: int = 2,
    max_runs: int = 12,
    timeout_s: float | None = None,
    on_run: Callable[[float, dict, list[Record]], None] | None = None,
) -> GoodputResult:
    """Warm up, then sweep (or search) the rate against ``client``; ``on_run(rate,
    summary, records)`` sees each rate."""
    tokenizer, max_len = model_info(model)
    if warmup:
        # at an infinite rate: for sharedprefix and multiturn a sample no rate draws
        if spec.name == "multiturn":
            reqs = first_turns(make_conversations(spec, tokenizer, warmup, math.inf, max_len))
        else:
            reqs = make_workload(spec, tokenizer, warmup, math.inf, max_len)
        asyncio.run(replay(client, reqs, timeout_s=timeout_s))

    def run(rate: float) -> list[Record]:
        n = max(1, round(rate * duration_s))
        label = f"rate {rate:g}/s"
        if spec.name == "multiturn":
            convs = make_conversations(spec, tokenizer, n, rate, max_len)
            return asyncio.run(replay_conversations(client, convs, label, timeout_s))
        reqs = make_workload(spec, tokenizer, n, rate, max_len)
        return asyncio.run(replay(client, reqs, label, timeout_s))

    def on_rate(rate: float, records: list[Record]) -> None:
        if on_run is not None:
            on_run(rate, summarize(records, slo), records)

    return search_goodput(run, slo, rates, search=search, max_runs=max_runs, on_rate=on_rate)


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
    endpoint: str | None = None,
    model: str | None = None,
    n_devices: int | None = None,
    log=print,
) -> dict:
    """Launch ``config`` (a path, dict or ClusterConfig), sweep or search the rate, and
    return (and write to ``out``, after every rate) the results. With ``endpoint``
    nothing is launched: that server is measured, ``config`` (optional) only gives
    the model and the device count, else ``model`` and ``n_devices`` (default 1)."""
    from pdserve.cluster.config_loader import load_config

    source = str(config) if isinstance(config, str | Path) else None
    config = load_config(config, overrides) if config is not None else None
    model = model or (config.model if config else None)
    if model is None:
        raise ValueError("give a config or the model (its tokenizer makes the requests)")
    n_devices = n_devices or (devices(config) if config else 1)
    results = {
        "config": source,
        "endpoint": endpoint,
        "model": model,
        "overrides": list(overrides),
        "cluster": config.to_dict() if config else None,
        "workload": asdict(spec),
        "duration_s": duration_s,
        "slo": asdict(slo),
        "devices": n_devices,
        "runs": [],
        "goodput": None,
    }
    replay_line = None
    if spec.name in PRODUCTION_TRACES:
        from pdserve.loadgen.trace_replay import trace_window

        results["trace_replay"] = trace_window(spec).to_dict()
        replay_line = f"bench: replay of {results['trace_replay']['summary']}"
        log(replay_line)

    def save() -> None:
        if out:
            Path(out).write_text(json.dumps(results, indent=1))

    def on_run(rate: float, summary: dict, records: list[Record]) -> None:
        log(describe(rate, summary))
        results["runs"].append(
            {"rate": rate, "summary": summary, "records": [r.to_dict() for r in records]}
        )
        save()

    with serving(config, endpoint, log) as client:
        result = measure(
            client,
            model,
            spec,
            rates,
            duration_s,
            slo,
            search=search,
            warmup=warmup,
            max_runs=max_runs,
            timeout_s=timeout_s,
            on_run=on_run,
        )
    results["goodput"] = goodput_dict(result, n_devices)
    save()
    log(describe_goodput(result, slo, n_devices))
    if replay_line:
        log(replay_line)
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
    p.add_argument("config", nargs="?", help="YAML file (configs/local-disagg.yaml)")
    p.add_argument("--endpoint", metavar="URL", help="measure this OpenAI-compatible server")
    p.add_argument("--out", default="bench-results.json", help="results JSON file")
    add_workload_arguments(p)


def main(args: argparse.Namespace) -> int:
    from pdserve.cluster.config_loader import ConfigError, load_config

    try:
        if args.config is None and not (args.endpoint and args.model):
            raise ValueError("give a config, or --endpoint URL with --model")
        config = load_config(args.config, args.set or []) if args.config else None
        rates, spec, slo = parse_common(args, config)
        if args.endpoint and spec.name == "multiturn":
            raise ValueError(NO_MULTITURN_ENDPOINT)
    except (ValueError, ConfigError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
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
        endpoint=args.endpoint,
        model=args.model,
        n_devices=args.devices,
        log=lambda line: print(line, flush=True),
    )
    print(f"bench: results in {args.out}", flush=True)
    return 0
