"""``pdserve compare``: the same workload (same seed, same requests) against several
configs in turn, then a side-by-side table, plots and a report.

    pdserve compare configs/local-colocated.yaml configs/local-disagg.yaml \\
        --workload sharegpt --rates 0.5,1,2 [--search] --duration 60 \\
        --slo-ttft-ms 1000 --slo-tpot-ms 150 --out compare/

Each config is launched, measured as ``pdserve bench`` measures it, and shut down
before the next one starts; ``--endpoint URL`` (repeatable) adds an external
OpenAI-compatible server. The out folder gets results.json (everything, each
request's record included), attainment-vs-rate.png, attainment-vs-slo-scale.png, tpot-cdf.png and
ttft-vs-rate.png and report.html (self-contained).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from pdserve.loadgen.metrics import SLO, Record, attainment
from pdserve.loadgen.runner import run_bench
from pdserve.loadgen.workload_args import (
    NO_MULTITURN_ENDPOINT,
    add_workload_arguments,
    parse_common,
)
from pdserve.loadgen.workloads import PRODUCTION_TRACES, WorkloadSpec

SLO_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)


def names_of(configs: list[str], endpoints: list[str]) -> list[str]:
    """A short, unique name per contender: the config file's stem, or the URL."""
    names: list[str] = []
    for raw in [Path(c).stem for c in configs] + list(endpoints):
        name, k = raw, 2
        while name in names:
            name, k = f"{raw}-{k}", k + 1
        names.append(name)
    return names


def records_at(contender: dict, rate: float) -> list[Record] | None:
    for run in contender["runs"]:
        if run["rate"] == rate:
            return [Record.from_dict(r) for r in run["records"]]
    return None


def pick_scale_rate(contenders: list[dict], rates: list[float], slo: SLO) -> float:
    """The highest of the rates every contender measured at which one of them meets
    the target (the interesting region); the lowest when none does."""
    passing = [
        rate
        for rate in rates
        if any(attainment(records_at(c, rate) or [], slo) >= slo.attainment for c in contenders)
    ]
    return max(passing, default=min(rates))


def slo_scale_curves(contenders: list[dict], rate: float, slo: SLO, scales) -> dict:
    """Attainment at ``rate`` with both objectives scaled, recomputed from the records."""
    curves = {}
    for c in contenders:
        records = records_at(c, rate) or []
        curves[c["name"]] = [attainment(records, slo.scaled(k)) for k in scales]
    return {"rate": rate, "scales": list(scales), "attainment": curves}


def run_compare(
    configs: list[str],
    spec: WorkloadSpec,
    rates: list[float],
    duration_s: float,
    slo: SLO,
    out_dir: str | Path,
    *,
    endpoints: list[str] = (),
    model: str | None = None,
    n_devices: int | None = None,
    scale_rate: float | None = None,
    slo_scales=SLO_SCALES,
    log=print,
    **bench,
) -> dict:
    """Measure each config (a path) then each endpoint with ``run_bench(**bench)``,
    write results.json after each and the report at the end; return the results."""
    from pdserve.loadgen.report import write_report

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = names_of([str(c) for c in configs], endpoints)
    results = {
        "workload": asdict(spec),
        "duration_s": duration_s,
        "slo": asdict(slo),
        "rates": sorted(set(rates)),
        "contenders": [],
    }
    if spec.name in PRODUCTION_TRACES:
        from pdserve.loadgen.trace_replay import trace_window

        results["trace_replay"] = trace_window(spec).to_dict()

    def save() -> None:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))

    todo = [(c, None) for c in configs] + [(None, e) for e in endpoints]
    for name, (config, endpoint) in zip(names, todo, strict=True):
        log(f"compare: {name}")
        one = run_bench(
            config,
            spec,
            rates,
            duration_s,
            slo,
            endpoint=endpoint,
            model=model,
            n_devices=n_devices if endpoint else None,
            log=log,
            **bench,
        )
        model = model or one["model"]  # the first config's model tokenizes for all
        results["contenders"].append({"name": name, **one})
        save()
    contenders = results["contenders"]
    devices = {c["name"]: c["devices"] for c in contenders}
    results["devices"] = devices
    results["same_devices"] = len(set(devices.values())) == 1
    rate = scale_rate if scale_rate is not None else pick_scale_rate(contenders, rates, slo)
    results["slo_scale"] = slo_scale_curves(contenders, rate, slo, slo_scales)
    save()
    text = write_report(results, out_dir)
    log(text)
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("configs", nargs="*", metavar="CONFIG", help="YAML files, measured in turn")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="also measure this OpenAI-compatible server (repeatable)",
    )
    p.add_argument("--out", default="compare", help="folder for results.json, plots, report")
    p.add_argument("--scale-rate", type=float, help="rate of the SLO-scale plot (one of --rates)")
    p.add_argument("--slo-scales", default=",".join(f"{k:g}" for k in SLO_SCALES))
    add_workload_arguments(p)


def main(args: argparse.Namespace) -> int:
    from pdserve.cluster.config_loader import ConfigError, load_config

    try:
        if len(args.configs) + len(args.endpoint) < 2:
            raise ValueError("give at least two configs or endpoints to compare")
        configs = [load_config(c, args.set or []) for c in args.configs]
        models = {c.model for c in configs}
        if len(models) > 1:
            raise ValueError(f"the configs serve different models: {', '.join(sorted(models))}")
        if not configs and not args.model:
            raise ValueError("with endpoints only, give --model (its tokenizer)")
        rates, spec, slo = parse_common(args, configs[0] if configs else None)
        if args.endpoint and spec.name == "multiturn":
            raise ValueError(NO_MULTITURN_ENDPOINT)
        scales = [float(k) for k in args.slo_scales.split(",") if k.strip()]
        if not scales or min(scales) <= 0:
            raise ValueError("--slo-scales: give positive factors, e.g. 0.5,1,2")
        if args.scale_rate is not None and args.scale_rate not in rates:
            raise ValueError("--scale-rate: must be one of --rates")
    except (ValueError, ConfigError) as e:
        print(f"pdserve compare: {e}", file=sys.stderr)
        return 2
    run_compare(
        args.configs,
        spec,
        rates,
        args.duration,
        slo,
        args.out,
        endpoints=args.endpoint,
        model=args.model,
        n_devices=args.devices,
        scale_rate=args.scale_rate,
        slo_scales=scales,
        log=lambda line: print(line, flush=True),
        search=args.search,
        warmup=args.warmup,
        max_runs=args.max_runs,
        timeout_s=args.timeout_s,
        overrides=args.set or [],
    )
    print(f"compare: report in {Path(args.out) / 'report.html'}", flush=True)
    return 0
