"""Engine vs HF transformers on the embedded model (float32, 2 threads), next to the
machine's floors measured in the same run.

    .venv/bin/python -m bench.engine [--threads 2] [--decode-steps 16]

Prefill: one prompt of 128 / 512 / 2048 tokens in one pass (HF computes the last
logit only), after a warm-up pass each, best of 5 passes that alternate between the
engine and HF. Decode: batch 1 / 8 / 32 of 128-token contexts, tokens/s over N steps,
best of 5 runs that alternate the same way. The machine is shared: a single run of
either can land on a busy moment, and alternating gives both sides the same chances.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.floors import best_of, copy_bandwidth, matmul_peak
from engine import LLM, SamplingParams
from engine.amx_gemm import amx_gemm
from engine.checkpoint import resolve

MODEL = "smollm2-135m"


def engine_prefill(llm: LLM, n: int):
    """A function that runs one prefill of n tokens."""
    ids = [(7 * i) % 40000 + 100 for i in range(n)]
    params = SamplingParams(max_tokens=1, temperature=0)
    return lambda: llm.generate(ids, params)


def engine_decode(llm: LLM, batch: int, steps: int, run: int, context: int = 128) -> float:
    e = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        ids = [100 + i + j % 50 for j in range(context)]
        e.add_request(f"d{batch}-{run}-{i}", ids, params)
    while any(r.num_output_tokens == 0 for r in e.requests.values()):
        e.step()  # prefill (and first token) of every request
    t = time.perf_counter()
    tokens = 0
    while e.has_unfinished_requests():
        tokens += len(e.step())
    return tokens / (time.perf_counter() - t)


def hf_prefill(model, n: int):
    """A function that runs HF's prefill of the same n tokens."""
    ids = torch.tensor([[(7 * i) % 40000 + 100 for i in range(n)]])

    def run():
        with torch.inference_mode():
            model(ids, logits_to_keep=1)

    return run


def alternating_best(fns: list, repeats: int) -> list[float]:
    """Each function's shortest wall time in seconds, over ``repeats`` rounds that call
    them in turn (after one warm-up call each)."""
    best = []
    for fn in fns:
        best.append(best_of(fn, repeats=1))
    for _ in range(repeats - 1):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def hf_decode(model, batch: int, steps: int, context: int = 128) -> float:
    ids = torch.tensor([[100 + i + j % 50 for j in range(context)] for i in range(batch)])
    with torch.inference_mode():
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, x = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(steps):
            out = model(x, cache=cache, use_cache=True)
            cache, x = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return batch * steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    print(f"threads {args.threads}, cpus {os.cpu_count()}, torch {torch.__version__}")
    bandwidth, peak = copy_bandwidth(), matmul_peak()
    print(
        f"floors: copy bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 matmul {peak / 1e9:.0f} GFLOP/s"
    )
    if amx_gemm() is not None:
        # prefill's projections run on AMX as three bfloat16 products per float32 one
        # (engine/amx_gemm.c): their ceiling is a third of the bfloat16 peak, if higher
        # (which reads 750-1700 GFLOP/s between calls here: the best of many)
        amx_peak = matmul_peak(dtype=torch.bfloat16, repeats=20) / 3
        print(f"AMX: bfloat16 matmul / 3 = {amx_peak / 1e9:.0f} float32-exact GFLOP/s")
        peak = max(peak, amx_peak)
    llm = LLM(MODEL, num_kv_blocks=1024, max_batch_tokens=2048, max_batch_size=64)
    hf = AutoModelForCausalLM.from_pretrained(resolve(MODEL), dtype=torch.float32).eval()
    cfg = llm.engine.model_config
    # every weight but the embedding (a lookup reads a few rows only); the LM head counts
    weight_bytes = 4 * sum(p.numel() for p in llm.engine.model.parameters())
    weight_bytes -= 4 * llm.engine.model.embed.numel()
    flops_per_token = 2 * (weight_bytes / 4)
    # decode at small batch reads every weight once per step
    decode_floor_s = weight_bytes / bandwidth
    prefill_ceiling = peak / flops_per_token
    print(
        f"model: {cfg.num_layers} layers, {weight_bytes / 1e6:.0f} MB of weights read per step; "
        f"decode step floor {decode_floor_s * 1e3:.1f} ms, "
        f"prefill ceiling {prefill_ceiling:.0f} tok/s"
    )
    rows = []
    for n in (128, 512, 2048):
        t_ours, t_theirs = alternating_best([engine_prefill(llm, n), hf_prefill(hf, n)], 5)
        ours, theirs = n / t_ours, n / t_theirs
        rows.append((f"prefill {n}", ours, theirs, f"{ours / prefill_ceiling:.0%} of ceiling"))
        print(_fmt(rows[-1]), flush=True)
    for b in (1, 8, 32):
        ours, theirs = 0.0, 0.0
        for run in range(5):
            ours = max(ours, engine_decode(llm, b, args.decode_steps, run))
            theirs = max(theirs, hf_decode(hf, b, args.decode_steps))
        step_ms = b / ours * 1e3
        floor = f"{step_ms / (decode_floor_s * 1e3):.2f}x floor ({step_ms:.1f} ms/step)"
        rows.append((f"decode batch {b}", ours, theirs, floor))
        print(_fmt(rows[-1]), flush=True)
    model = llm.engine.model
    twins = [t for layer in model.layers for t in layer.panels.values()]
    twins += [model.lm_head_panels] if model.lm_head_panels is not None else []
    streamed = sum(t.panels.nbytes for t in twins)
    print(
        f"decode streams {streamed / 1e6:.0f} MB of packed weights a step (the GGUF's Q4_1 / "
        f"Q8_0 blocks where its floats are exactly those); floor from those bytes "
        f"{streamed / bandwidth * 1e3:.1f} ms; the floors above count float32 weights"
    )
    print("\n| | pdserve tok/s | HF tok/s | ratio | distance from floor |")
    print("|---|---|---|---|---|")
    for name, ours, theirs, floor in rows:
        print(f"| {name} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x | {floor} |")


def _fmt(row):
    name, ours, theirs, floor = row
    ratio = ours / theirs
    return f"{name:>16}: pdserve {ours:7.0f} tok/s  HF {theirs:7.0f} tok/s  x{ratio:.2f}  {floor}"


if __name__ == "__main__":
    main()
