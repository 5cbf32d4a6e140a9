"""Overload: what the admitted requests get at twice the capacity, with and without
load shedding (``router.max_expected_ttft_s``), in one run.

    python -m pdserve.bench.overload configs/local-colocated.yaml [--factor 2] [--duration 60]
        [--max-tokens 32] [--max-prompt-tokens 256] [--shed-s 0.5] [--out results/overload]

1. Capacity: on the config as given (no shedding), a burst of ``--probe`` ShareGPT
   requests sent at once; capacity = requests completed per second of the burst.
2. The same cluster, Poisson arrivals at ``--factor`` x capacity for ``--duration``
   seconds: the baseline, where every request queues (until ``router.queue_timeout_s``).
3. A cluster with ``router.max_expected_ttft_s = --shed-s`` (default half the config's
   TTFT objective), the same arrivals.

Per run: requests sent, admitted (not refused), refused and how fast (RESOURCE_EXHAUSTED
on arrival, or later from the queue), the SLO attainment of the admitted requests
(TTFT and TPOT against the config's ``slo``), goodput (requests per second that met
both) and TTFT percentiles; the ratios shedding / baseline; a plot of each request's
TTFT against its send time (refusals marked). Figures in docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.loadgen.metrics import SLO, percentile
from pdserve.loadgen.workloads import WorkloadSpec, make_workload, model_info


@dataclass
class Outcome:
    sent_s: float  # after the start of the run
    seconds: float  # sent -> answered (completed or refused)
    refused: bool = False
    error: str | None = None  # a failure other than a refusal
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def meets(self, slo: SLO) -> bool:
        ok = not self.refused and self.error is None and self.ttft_ms is not None
        return ok and self.ttft_ms <= slo.ttft_ms and self.tpot_ms <= slo.tpot_ms


async def _send(client, req, start: float, timeout_s: float) -> Outcome:
    import grpc

    await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
    sent = time.monotonic()
    out = Outcome(sent - start, 0.0)
    try:
        done = await client.acomplete(
            prompt_token_ids=req.prompt_token_ids,
            max_tokens=req.output_len,
            temperature=0.0,
            ignore_eos=True,
            timeout=timeout_s,
        )
        out.ttft_ms, out.tpot_ms = done.timings.ttft_ms, done.timings.tpot_ms
    except grpc.aio.AioRpcError as e:
        out.refused = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        out.error = None if out.refused else f"{e.code().name}: {e.details()}"
    out.seconds = time.monotonic() - sent
    return out


async def _run(client, requests, label: str, timeout_s: float) -> list[Outcome]:
    start = time.monotonic()
    tasks = [asyncio.ensure_future(_send(client, r, start, timeout_s)) for r in requests]
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=5.0)
            done = sum(t.done() for t in tasks)
            sys.stderr.write(
                f"overload: {label}: {done}/{len(tasks)} answered, "
                f"{time.monotonic() - start:.0f} s\n"
            )
    finally:
        await client.aclose()
    return [t.result() for t in tasks]


def summarize(outcomes: list[Outcome], duration_s: float, slo: SLO) -> dict:
    admitted = [o for o in outcomes if not o.refused]
    refused = [o for o in outcomes if o.refused]
    met = [o for o in admitted if o.meets(slo)]
    ttfts = [o.ttft_ms for o in admitted if o.ttft_ms is not None]
    refusal_ms = [o.seconds * 1e3 for o in refused]
    return {
        "sent": len(outcomes),
        "admitted": len(admitted),
        "refused": len(refused),
        "failed": sum(1 for o in admitted if o.error is not None),
        "refusal_p50_ms": percentile(refusal_ms, 50),
        "refusal_p99_ms": percentile(refusal_ms, 99),
        "attainment_admitted": len(met) / len(admitted) if admitted else None,
        "goodput_rps": len(met) / duration_s,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
    }


def _plot(runs: dict[str, list[Outcome]], slo: SLO) -> bytes:
    from pdserve.loadgen.plots import figure, save

    plt, fig, (ax,) = figure()
    for (label, outcomes), color in zip(runs.items(), ("tab:red", "tab:blue"), strict=False):
        served = [(o.sent_s, o.ttft_ms / 1e3) for o in outcomes if o.ttft_ms is not None]
        refused = [o.sent_s for o in outcomes if o.refused]
        ax.scatter(*zip(*served, strict=True), s=6, color=color, label=f"{label}: TTFT")
        if refused:
            ax.scatter(
                refused,
                [0] * len(refused),
                s=10,
                marker="x",
                color=color,
                alpha=0.4,
                label=f"{label}: refused",
            )
    ax.axhline(slo.ttft_ms / 1e3, color="grey", linestyle=":", label="TTFT objective")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sent (s after the start)")
    ax.set_ylabel("TTFT (s)")
    return save(plt, fig, ax)


def main(args: argparse.Namespace) -> int:
    from pdserve.cluster.config_loader import load_config
    from pdserve.cluster.launcher import launch

    config = load_config(args.config, args.set or [])
    slo = SLO(config.slo.ttft_ms, config.slo.tpot_ms, config.slo.attainment)
    shed_s = args.shed_s if args.shed_s is not None else slo.ttft_ms / 2e3
    tokenizer, max_len = model_info(config.model)
    spec = WorkloadSpec(max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_tokens)
    timeout_s = config.router.queue_timeout_s + 120
    runs: dict[str, list[Outcome]] = {}
    with launch(config) as cluster:
        client = cluster.client()
        probe = make_workload(spec, tokenizer, args.probe, math.inf, max_len)
        started = time.monotonic()
        outcomes = asyncio.run(_run(client, probe, "capacity probe", timeout_s))
        capacity = sum(o.error is None for o in outcomes) / (time.monotonic() - started)
        rate = args.factor * capacity
        n = round(rate * args.duration)
        print(
            f"overload: capacity {capacity:.2f} req/s; sending {n} at {rate:.2f} req/s "
            f"({args.factor:g}x) for {args.duration:g} s"
        )
        spec.seed = 1
        requests = make_workload(spec, tokenizer, n, rate, max_len)
        runs["baseline (no shedding)"] = asyncio.run(
            _run(cluster.client(), requests, "baseline", timeout_s)
        )
    shed = [*(args.set or []), f"router.max_expected_ttft_s={shed_s}"]
    with launch(load_config(args.config, shed)) as cluster:
        runs[f"max_expected_ttft_s={shed_s:g}"] = asyncio.run(
            _run(cluster.client(), requests, "shedding", timeout_s)
        )
    table = {label: summarize(o, args.duration, slo) for label, o in runs.items()}
    _print(table, capacity, rate, slo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = {label: [asdict(o) for o in outcomes] for label, outcomes in runs.items()}
    figures = {"capacity_rps": capacity, "rate_rps": rate, "slo": asdict(slo), "runs": table}
    (out / "overload.json").write_text(json.dumps({**figures, "requests": raw}, indent=1))
    (out / "overload.png").write_bytes(_plot(runs, slo))
    print(f"overload: {out / 'overload.json'}, {out / 'overload.png'}")
    return 0


def _print(table: dict, capacity: float, rate: float, slo: SLO) -> None:
    def f(v, spec=".0f"):
        return "-" if v is None else format(v, spec)

    print(
        f"\ncapacity {capacity:.2f} req/s, offered {rate:.2f} req/s; SLO TTFT "
        f"{slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms"
    )
    print(
        f"{'run':<26}{'sent':>6}{'admit':>7}{'refuse':>8}{'ref p99 ms':>11}"
        f"{'attain':>8}{'goodput':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
    )
    for label, s in table.items():
        print(
            f"{label:<26}{s['sent']:>6}{s['admitted']:>7}{s['refused']:>8}"
            f"{f(s['refusal_p99_ms']):>11}{f(s['attainment_admitted'], '.0%'):>8}"
            f"{s['goodput_rps']:>9.2f}{f(s['ttft_p50_ms']):>10}"
            f"{f(s['ttft_p99_ms']):>10}"
        )
    base, shed = table.values()
    if base["goodput_rps"]:
        print(f"goodput shedding / baseline: {shed['goodput_rps'] / base['goodput_rps']:.2f}x")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML file (configs/local-colocated.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    p.add_argument("--factor", type=float, default=2.0, help="offered load / capacity")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of overload")
    p.add_argument("--probe", type=int, default=48, help="requests of the capacity burst")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens, at most")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="prompt tokens, at most")
    p.add_argument(
        "--shed-s", type=float, default=None, help="router.max_expected_ttft_s (TTFT SLO/2)"
    )
    p.add_argument("--out", default="results/overload", help="folder of the JSON and the plot")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
