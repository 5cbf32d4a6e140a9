"""A prefill pass's projections on the embedded model, each way the CPU allows, in one
process, on the ISA of the kernels in use (engine/native.py; ``PDSERVE_CPU_ISA`` forces
one, and for AVX2 cap torch's libraries the same way: bench/engine.py's LIBRARY_CAPS).

    .venv/bin/python -m pdserve.bench.prefill_gemm [--rows 128,512,2048] [--rounds 3]

The 120 layer projections of a pass (30 layers x qkv, o, gate_up, down; prefill takes
the LM head for the last token only):
- ``F.linear``: MKL on the checkpoint-layout weights, what HF transformers runs;
- ``oneDNN packed``: torch's oneDNN linear on weights reordered once into its blocked
  layout (``torch.ops.mkldnn._reorder_linear_weight``), the library a CPU engine would
  take instead of its own kernel;
- ``panels``: ``engine/cpu_gemm.c`` on the GGUF's Q4_1 blocks, the engine's path (on
  CPUs with AMX, batches above 64 rows take ``AMX blocks`` instead);
- ``AMX blocks``: ``engine/amx_gemm.c``, each float32 product as three exact bfloat16
  ones, where the CPU has AMX.
Best of ``--rounds`` rounds, the ways taking turns within each round; GFLOP/s count
float32 multiply-adds (2 M N K).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pdserve.bench.decode_gemm import best_times
from pdserve.engine import LLM, native
from pdserve.engine.amx_gemm import amx_gemm
from pdserve.engine.cpu_gemm import MAX_ROWS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="128,512,2048")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = LLM("smollm2-135m", num_kv_blocks=64).engine.model
    twins = [layer.panels[n] for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    amx = amx_gemm()
    print(
        f"kernels: {native.isa()}, AMX {'yes' if amx else 'no'}; torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()})"
    )
    reordered = [torch.ops.mkldnn._reorder_linear_weight(t.weight, 512) for t in twins]
    ways = {
        "F.linear": [(t.in_features, lambda x, w=t.weight: F.linear(x, w)) for t in twins],
        "oneDNN packed": [
            (
                t.in_features,
                lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            )
            for t, w in zip(twins, reordered, strict=True)
        ],
        # the kernel itself, not AMX: where AMX takes these batches, its own row follows
        "panels": [(t.in_features, lambda x, t=t: _panels_only(t, x)) for t in twins],
    }
    if amx is not None:
        ways["AMX blocks"] = [
            (t.in_features, lambda x, t=t: amx(x, t.panels, t.format, t.out_features))
            for t in twins
        ]
    print(
        "| rows | "
        + " | ".join(f"{n} ms" for n in ways)
        + " | panels GFLOP/s | "
        + " | ".join(f"panels vs {n}" for n in ways if n != "panels")
        + " |"
    )
    print("|---" * (2 * len(ways) + 1) + "|")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {t.in_features for t in twins}}
        best = best_times(ways, xs, args.rounds)
        flops = sum(2 * rows * t.in_features * t.out_features for t in twins)
        ours = best["panels"]
        cells = [f"{best[n] * 1e3:.0f}" for n in ways] + [f"{flops / ours / 1e9:.0f}"]
        cells += [f"{best[n] / ours:.2f}x" for n in ways if n != "panels"]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


def _panels_only(twin, x: torch.Tensor) -> torch.Tensor:
    """The panel kernel on any batch, bypassing AMX above ``MAX_ROWS`` rows."""
    if x.shape[0] <= MAX_ROWS or twin.amx is None:
        return twin(x)
    amx, twin.amx = twin.amx, None
    try:
        return twin(x)
    finally:
        twin.amx = amx


if __name__ == "__main__":
    main()
