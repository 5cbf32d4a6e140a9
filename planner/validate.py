"""Simulate ``pdserve bench`` runs: the same configs, requests (same seed, same token
counts, same arrival times) and SLO, on a cost model, to set beside measured results.

    python -m pdserve.planner.validate configs/local-colocated.yaml configs/local-disagg.yaml \\
        --profile profile.json --workload longprompt --long-prompt-mean 512 \\
        --long-output-mean 64 --rates 0.2,0.4,0.6 --duration 60 \\
        --slo-ttft-ms 4000 --slo-tpot-ms 150 [--search]

With ``--search`` the goodput is bracketed and bisected as ``pdserve bench --search``
does, on simulated runs.
"""

from __future__ import annotations

import argparse

from pdserve.loadgen.metrics import SLO, search_goodput, summarize
from pdserve.loadgen.workloads import WorkloadSpec, make_workload
from pdserve.planner.cluster_spec import from_cluster_config
from pdserve.planner.simulator import simulate
from pdserve.planner.workload import _tokenizer


def simulate_bench(
    config_path: str, cost, spec: WorkloadSpec, rates, duration_s, slo: SLO, search=False
):
    """(rate -> (summary, records), goodput result), as ``pdserve bench`` would measure."""
    from pdserve.cluster.config_loader import load_config
    from pdserve.engine.checkpoint import load_checkpoint

    config = load_config(config_path)
    cluster = from_cluster_config(config)
    tokenizer = _tokenizer(config.model)
    max_len = load_checkpoint(config.model).config.max_position
    out = {}

    def run(rate: float):
        n = max(1, round(rate * duration_s))
        reqs = make_workload(spec, tokenizer, n, rate, max_len)
        records = simulate(cluster, cost, [(r.arrival_s, len(r[1]), r.output_len) for r in reqs])
        out[rate] = (summarize(records, slo), records)
        return records

    result = search_goodput(run, slo, rates, search=search)
    return dict(sorted(out.items())), result


def prefill_ms(records) -> float:
    """Mean time from leaving the router's queue to the prompt's last chunk done."""
    spans = [r.phases["prefill_end"] - r.queue_ms for r in records if r.ok]
    return sum(spans) / len(spans) if spans else 0.0


def main(argv=None) -> None:
    from pdserve.loadgen.workload_args import add_workload_arguments, parse_common
    from pdserve.planner.fitted import FittedCost

    p = argparse.ArgumentParser(prog="pdserve.planner.validate")
    p.add_argument("configs", nargs="+")
    p.add_argument("--profile", required=True)
    add_workload_arguments(p)
    args = p.parse_args(argv)
    rates, spec, slo = parse_common(args, None)
    cost = FittedCost.load(args.profile)
    for path in args.configs:
        runs, result = simulate_bench(path, cost, spec, rates, args.duration, slo, args.search)
        for rate, (s, records) in runs.items():
            print(
                f"{path} @ {rate:g}/s: attainment {s['attainment']:.2f} "
                f"(TTFT {s['attainment_ttft']:.2f}, TPOT {s['attainment_tpot']:.2f}), "
                f"TTFT p50/p90 {s['p50_ttft_ms']:.0f}/{s['p90_ttft_ms']:.0f} ms, "
                f"TPOT p50/p90 {s['p50_tpot_ms']:.0f}/{s['p90_tpot_ms']:.0f} ms, "
                f"prefill {prefill_ms(records):.0f} ms"
            )
        goodput = f"{result.goodput:.3g} req/s" if result.met else "none"
        print(f"{path}: simulated goodput {goodput}")


if __name__ == "__main__":
    main()
