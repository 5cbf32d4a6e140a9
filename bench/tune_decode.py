"""Sweep the paged decode kernel's tiling on a GPU: python -m pdserve.bench.tune_decode

For each (BLOCK_N, NUM_WARPS, NUM_STAGES, MIN_PARTITION, PROGRAMS_PER_SM) it checks
the kernel against ``ref_paged_decode_attention`` on fresh random inputs, then times
it at the serving shapes of bench/kernels.py (bf16) and prints, per shape, the best
configuration next to the current defaults, as a share of the measured copy bandwidth.
"""

from __future__ import annotations

import importlib
import itertools
import sys
from functools import partial

import torch

if __package__ in (None, ""):
    sys.exit("bench/tune_decode.py: run it as a module: python -m pdserve.bench.tune_decode")
if not torch.cuda.is_available():
    sys.exit("bench/tune_decode.py needs a CUDA GPU")

from triton.testing import do_bench  # noqa: E402

from pdserve.bench.kernels import BF16, BLOCK, DECODE_SHAPES, LAYOUTS, device_peaks, paged  # noqa: E402

pda = importlib.import_module("pdserve.kernels.paged_decode_attention")
KNOBS = ("BLOCK_N", "NUM_WARPS", "NUM_STAGES", "MIN_PARTITION", "PROGRAMS_PER_SM")
GRID = list(itertools.product((64, 128), (2, 4, 8), (2, 3), (256, 1024), (4, 16)))


def ms(fn) -> float:
    return do_bench(fn, warmup=5, rep=20, return_mode="median")


def use(config) -> None:
    for knob, value in zip(KNOBS, config, strict=True):
        setattr(pda, knob, value)


def correct(config) -> bool:
    use(config)
    lens = [1, BLOCK - 1, BLOCK + 1, 700, 3000]
    k, v, tables = paged(lens, 2, 128, BF16)
    q = torch.randn(len(lens), 8, 128, dtype=BF16, device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    pda.paged_decode_attention(q, k, v, seq, tables, 0.1, max_seq_len=max(lens), out=out)
    ref = pda.ref_paged_decode_attention(q, k, v, seq, tables, 0.1)
    return bool(torch.allclose(out.float(), ref.float(), atol=3e-2, rtol=2e-2))


def main() -> None:
    bw, _ = device_peaks()
    defaults = tuple(getattr(pda, knob) for knob in KNOBS)
    good = [c for c in GRID if correct(c)]
    print(f"copy {bw / 1e12:.2f} TB/s; {len(good)}/{len(GRID)} configs correct", flush=True)
    print(f"knobs {KNOBS}; defaults {defaults}")
    score: dict[tuple, float] = {c: 0.0 for c in good}
    for name, (hq, hkv, d) in LAYOUTS.items():
        for b, n in DECODE_SHAPES:
            k, v, tables = paged([n] * b, hkv, d, BF16)
            q = torch.randn(b, hq, d, dtype=BF16, device="cuda")
            seq = torch.full((b,), n, dtype=torch.int32, device="cuda")
            nbytes = 2 * b * n * hkv * d * 2
            call = partial(pda.paged_decode_attention, q, k, v, seq, tables, 0.1, n)
            times = {}
            for c in good:
                use(c)
                times[c] = ms(call)
            best = min(times, key=times.get)
            for c in good:
                score[c] += times[best] / times[c]
            frac = nbytes / (times[best] * 1e-3) / bw
            base = nbytes / (times[defaults] * 1e-3) / bw if defaults in times else float("nan")
            print(
                f"{name:13s} B={b:<3d} ctx={n:<6d} best {best} {times[best] * 1e3:7.1f} us "
                f"{frac:4.0%} | defaults {base:4.0%}",
                flush=True,
            )
    ranked = sorted(score, key=score.get, reverse=True)[:5]
    print("best overall (mean share of each shape's best):")
    for c in ranked:
        print(f"  {c}: {score[c] / (2 * len(DECODE_SHAPES)):.2f}")


if __name__ == "__main__":
    main()
