"""What the C decode layers (engine/cpu_layer.py) save on the embedded Llama model: the
batch-1 decode step in ms with them and with the per-op torch layers every family but
Llama runs (docs/models.md quotes it as the cost of the fall-back).

    .venv/bin/python -m pdserve.bench.decode_fast_path [--threads 2] [--steps 32]

One request of a 128-token context decodes ``--steps`` tokens; the median step time of
each path, best of 5 runs that alternate between the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.engine import LLM, SamplingParams

MODEL = "smollm2-135m"


def step_ms(llm: LLM, steps: int) -> float:
    """Median ms of one decode step of one request."""
    engine = llm.engine
    engine.add_request(
        "r",
        [100 + j % 50 for j in range(128)],
        SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True),
    )
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(MODEL, enable_prefix_caching=False)
    llm.engine.model.pack_panels()
    fast = llm.engine.model.cpu_decode
    if fast is None:
        raise SystemExit("the C decode layers cannot run here (no compiler or not float32 CPU)")
    best = {"C decode layers": float("inf"), "torch layers": float("inf")}
    step_ms(llm, 4)  # warm-up
    for _ in range(5):
        for name, path in (("C decode layers", fast), ("torch layers", None)):
            llm.engine.model.cpu_decode = path
            best[name] = min(best[name], step_ms(llm, args.steps))
    llm.engine.model.cpu_decode = fast
    for name, ms in best.items():
        print(f"{name:>16}: {ms:6.2f} ms per batch-1 decode step")
    ratio = best["torch layers"] / best["C decode layers"]
    print(f"the torch layers take {ratio:.2f}x the C layers' step")


if __name__ == "__main__":
    main()
