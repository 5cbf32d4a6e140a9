"""A prefill pass's projections on the embedded model, three ways in one process.

    .venv/bin/python -m bench.prefill_gemm [--rows 128,512,2048] [--rounds 3]

The 120 layer projections of a pass (30 layers x qkv, o, gate_up, down; prefill takes
the LM head for the last token only):
- ``F.linear``: MKL on the checkpoint-layout weights, what HF transformers runs;
- ``MKL packed``: MKL on weights packed once (``engine/mkl_packed.py``), the engine's
  prefill GEMM where the CPU has no AMX;
- ``AMX blocks``: ``engine/amx_gemm.c`` on the GGUF's Q4_1 blocks, each float32
  product as three exact bfloat16 ones (the engine's default where the CPU has AMX).
Best of ``--rounds`` rounds, the three taking turns within each round; GFLOP/s count
float32 multiply-adds (2 M N K).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.decode_gemm import best_times
from engine import LLM
from engine.amx_gemm import amx_gemm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="128,512,2048")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    amx = amx_gemm()
    if amx is None:
        sys.exit("no AMX on this machine (CPU, compiler or kernel): nothing to compare")
    model = LLM("smollm2-135m", num_kv_blocks=64).engine.model
    names = ("qkv", "o", "gate_up", "down")
    twins = [(layer.panels[n], layer.packed[n]) for layer in model.layers for n in names]
    for panels, _ in twins:
        panels.panels  # noqa: B018 (packs them)
    ways = {
        "F.linear": [(p.in_features, lambda x, w=p.weight: F.linear(x, w)) for p, _ in twins],
        "MKL packed": [(p.in_features, packed) for p, packed in twins],
        "AMX blocks": [
            (p.in_features, lambda x, p=p: amx(x, p.panels, p.format, p.out_features))
            for p, _ in twins
        ],
    }
    head = ["rows", "F.linear ms", "MKL packed ms", "AMX blocks ms", "AMX GFLOP/s"]
    print("| " + " | ".join(head + ["vs F.linear", "vs MKL packed"]) + " |")
    print("|---|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {p.in_features for p, _ in twins}}
        best = best_times(ways, xs, args.rounds)
        f, m, a = (best[n] for n in ways)
        flops = sum(2 * rows * p.in_features * p.out_features for p, _ in twins)
        print(
            f"| {rows} | {f * 1e3:.0f} | {m * 1e3:.0f} | {a * 1e3:.0f} | {flops / a / 1e9:.0f} "
            f"| {f / a:.2f}x | {m / a:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
