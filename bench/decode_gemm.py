"""A decode step's projections on the embedded model, three ways in one process, on the
ISA of the kernels in use (engine/native.py; ``PDSERVE_CPU_ISA`` forces one).

    .venv/bin/python -m pdserve.bench.decode_gemm [--rows 1,8,32,64] [--rounds 4]

All 121 projections of a step (30 layers x qkv, o, gate_up, down, then the LM head),
each weight distinct as in a real step, so that they stream from memory:
- ``F.linear``: MKL on the checkpoint-layout weights, what HF transformers runs;
- ``panels f32``: ``engine/cpu_gemm.c`` on float32 panels;
- ``panels blocks``: the same kernel on the GGUF's Q4_1 / Q8_0 blocks found in the
  floats (the engine's default; the products equal the float32 panels' bit for bit).
Best of ``--rounds`` rounds, the three taking turns within each round.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pdserve.engine import LLM, native
from pdserve.engine.cpu_gemm import PanelWeight, cpu_gemm


def step_time(fns, xs: dict[int, torch.Tensor]) -> float:
    """Seconds for one pass over fns (each takes x [rows, in] by its in_features)."""
    t = time.perf_counter()
    for k, fn in fns:
        fn(xs[k])
    return time.perf_counter() - t


def best_times(ways: dict[str, list], xs: dict[int, torch.Tensor], rounds: int) -> dict:
    """Each way's shortest pass in seconds over ``rounds`` rounds in which the ways take
    turns (each pass after a warm one)."""
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(rounds):
        for name, fns in ways.items():
            step_time(fns, xs)  # warm
            best[name] = min(best[name], step_time(fns, xs))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = LLM("smollm2-135m", num_kv_blocks=64).engine.model
    blocks = [t for layer in model.layers for t in layer.panels.values()] + [model.lm_head_panels]
    floats = [PanelWeight(cpu_gemm(), t.weight, formats=()) for t in blocks]
    ways = {
        "F.linear": [(t.in_features, lambda x, w=t.weight: F.linear(x, w)) for t in blocks],
        "panels f32": [(t.in_features, t) for t in floats],
        "panels blocks": [(t.in_features, t) for t in blocks],
    }
    for t in blocks + floats:
        t.panels  # noqa: B018 (packs them)
    f32_mb, blocks_mb = (sum(t.panels.nbytes for t in ts) / 1e6 for ts in (floats, blocks))
    print(
        f"kernels: {native.isa()}; weights streamed a step: float32 panels {f32_mb:.0f} MB, "
        f"blocks {blocks_mb:.0f} MB"
    )
    print("| rows | F.linear ms | panels f32 ms | panels blocks ms | blocks vs F.linear |")
    print("|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {t.in_features for t in blocks}}
        best = best_times(ways, xs, args.rounds)
        f, p, b = (best[n] * 1e3 for n in ways)
        print(f"| {rows} | {f:.1f} | {p:.1f} | {b:.1f} | {f / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
