"""The workload and SLO options ``pdserve bench``, ``pdserve compare`` and the planner's
validation share, and their parsing into rates, a ``WorkloadSpec`` and an ``SLO``."""

from __future__ import annotations

import argparse

from pdserve.loadgen.metrics import SLO
from pdserve.loadgen.workloads import PRODUCTION_TRACES, WORKLOADS, WorkloadSpec

NO_MULTITURN_ENDPOINT = (
    "--workload multiturn: not with --endpoint (the next turn carries the answer's token "
    "ids, which only the router's client returns)"
)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``pdserve bench`` and ``pdserve compare`` share."""
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    p.add_argument("--workload", default="sharegpt", choices=WORKLOADS)
    p.add_argument("--trace", help="trace file (--workload trace, azure, mooncake)")
    p.add_argument("--rates", help="comma-separated request rates (per second; default 1)")
    p.add_argument("--search", action="store_true", help="then search the goodput by bisection")
    p.add_argument("--max-runs", type=int, default=12, help="rates measured at most (--search)")
    p.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="seconds of arrivals per rate; azure, mooncake: trace seconds of the window",
    )
    add_trace_arguments(p)
    p.add_argument("--slo-ttft-ms", type=float, help="default: the config's slo.ttft_ms")
    p.add_argument("--slo-tpot-ms", type=float, help="default: the config's slo.tpot_ms")
    p.add_argument("--attainment", type=float, help="default: the config's slo.attainment")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape; 1 is Poisson")
    p.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt lengths")
    p.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    p.add_argument("--max-prompt-tokens", type=int, help="cap prompt lengths")
    p.add_argument("--max-output-tokens", type=int, help="cap output lengths")
    p.add_argument("--long-prompt-mean", type=int, default=1500, help="--workload longprompt")
    p.add_argument("--long-output-mean", type=int, default=90, help="--workload longprompt")
    p.add_argument("--system-prompts", type=int, default=8, help="--workload sharedprefix")
    p.add_argument("--system-prompt-tokens", type=int, default=750, help="their mean length")
    p.add_argument("--max-turns", type=int, default=5, help="--workload multiturn")
    p.add_argument("--think-time-s", type=float, default=5.0, help="mean pause between turns")
    p.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    p.add_argument("--timeout-s", type=float, help="per-request deadline")
    p.add_argument("--model", help="with --endpoint and no config: tokenizes the requests")
    p.add_argument("--devices", type=int, help="with --endpoint: the devices it uses (1)")


def add_trace_arguments(p) -> None:
    """The window and scales of ``--workload azure`` and ``mooncake`` (a parser or a
    group of one that has ``--duration``)."""
    p.add_argument(
        "--start",
        dest="trace_start_s",
        type=float,
        default=0.0,
        help="azure, mooncake: the window's start, seconds after the trace's first request",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="azure, mooncake: multiply every arrival gap (2: half the trace's rate, same shape)",
    )
    p.add_argument(
        "--token-scale",
        type=float,
        default=1.0,
        help="azure, mooncake: multiply prompt "
        "and output lengths (and Mooncake's 512-token blocks)",
    )


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The workload of the command line; options a command does not offer keep the
    defaults. ``--duration`` is the trace window's length for azure and mooncake."""
    given = {f: getattr(args, f) for f in WorkloadSpec.__dataclass_fields__ if hasattr(args, f)}
    if args.workload in PRODUCTION_TRACES:
        given["trace_duration_s"] = args.duration
    return WorkloadSpec(args.workload, **{k: v for k, v in given.items() if k != "name"})


def trace_rates(args: argparse.Namespace, spec: WorkloadSpec) -> list[float]:
    """The one rate of a trace replay: its window's offered rate (its arrivals and the
    time scale set it)."""
    from pdserve.loadgen.trace_replay import trace_window

    if args.rates is not None or getattr(args, "search", False):
        raise ValueError(
            f"--rates, --search: not with --workload {spec.name}; the trace's arrivals "
            "and --time-scale set the rate"
        )
    return [trace_window(spec).offered_rate]


def parse_common(args: argparse.Namespace, config) -> tuple[list[float], WorkloadSpec, SLO]:
    """The rates, the workload and the SLO of the command line (``config``, a checked
    ClusterConfig or None, gives the SLO's defaults); ValueError when they are wrong."""
    spec = workload_spec(args)
    if spec.name in PRODUCTION_TRACES:
        rates = trace_rates(args, spec)
    else:
        rates = [float(r) for r in (args.rates or "1").split(",") if r.strip()]
    if not rates or min(rates) <= 0:
        raise ValueError("--rates: give positive rates, e.g. 0.5,1,2")
    default = config.slo if config is not None else SLO()
    slo = SLO(
        args.slo_ttft_ms or default.ttft_ms,
        args.slo_tpot_ms or default.tpot_ms,
        args.attainment or default.attainment,
    )
    return rates, spec, slo
