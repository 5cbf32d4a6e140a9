"""A mixed trace of short and long prompts for ``pdserve bench --workload trace``: the
case hybrid mode is for (docs/benchmarks.md, "Workloads"; docs/performance.md,
"Co-located, disaggregated and hybrid").

    python -m pdserve.bench.mixed_trace --out mixed.jsonl [--long 600 --long-share 0.25]

Poisson arrivals at 1 per second (``pdserve bench`` rescales them to each rate); a
share ``--long-share`` of the prompts is long (``--long`` tokens, 0.5x-1.5x uniform),
the rest short (``--short`` tokens, same spread); outputs of ``--output`` tokens (same
spread). Prompt lengths only: the runner cuts the prompts from ShareGPT text.
"""

from __future__ import annotations

import argparse
import json
import random

from pdserve.loadgen.workloads import arrival_times


def mixed_trace(
    n: int, long_share: float, short: int, long: int, output: int, seed: int = 0
) -> list[dict]:
    """``n`` rows of ``arrival_s``, ``prompt_len``, ``output_len``."""
    rng = random.Random(seed)

    def spread(mean: int) -> int:
        return max(1, round(mean * rng.uniform(0.5, 1.5)))

    rows = []
    for t in arrival_times(n, 1.0, seed=seed):
        prompt = spread(long if rng.random() < long_share else short)
        rows.append({"arrival_s": round(t, 4), "prompt_len": prompt, "output_len": spread(output)})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="pdserve.bench.mixed_trace", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("-n", type=int, default=200, help="requests")
    p.add_argument("--long-share", type=float, default=0.25, help="share of long prompts")
    p.add_argument("--short", type=int, default=48, help="mean tokens of a short prompt")
    p.add_argument("--long", type=int, default=1200, help="mean tokens of a long prompt")
    p.add_argument("--output", type=int, default=48, help="mean output tokens")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rows = mixed_trace(a.n, a.long_share, a.short, a.long, a.output, a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
