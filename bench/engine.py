"""Engine vs HF transformers on the embedded model (float32, 2 threads), next to the
machine's floors measured in the same run, then on a second family's tiny checkpoint.

    .venv/bin/python -m bench.engine [--threads 2] [--decode-steps 16] [--family gemma2]

Prefill: one prompt of 128 / 512 / 2048 tokens in one pass (HF computes the last
logit only), after a warm-up pass each, best of 5 passes that alternate between the
engine and HF. Decode: batch 1 / 8 / 32 of 128-token contexts, tokens/s over N steps,
best of 5 runs that alternate the same way. The machine is shared: a single run of
either can land on a busy moment, and alternating gives both sides the same chances.

The second section (``--family``, a name of tests/family_models.py, default Gemma 2;
``none`` skips it) runs prefill 128 / 512 and decode batch 1 / 8 the same way on that
family's tiny random checkpoint (hidden 64). Gemma 2, Gemma 3, Qwen2 and Qwen3 decode on
the per-op torch layers, not the embedded Llama's C decode layers (docs/models.md, "The
C decode fast path"); at this size a step is nearly all per-op overhead, so a
regression in that generic path shows as a drop of its ratio to HF.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.floors import best_of, copy_bandwidth, matmul_peak
from engine import LLM, SamplingParams
from engine.amx_gemm import amx_gemm
from engine.checkpoint import resolve

MODEL = "smollm2-135m"


def prompt_ids(n: int, vocab: int) -> list[int]:
    """The prefill prompt of n tokens: ids in [100, vocab) (vocab > 100)."""
    return [(7 * i) % min(40000, vocab - 100) + 100 for i in range(n)]


def engine_prefill(llm: LLM, n: int):
    """A function that runs one prefill of n tokens."""
    ids = prompt_ids(n, llm.engine.model_config.vocab_size)
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
    ids = torch.tensor([prompt_ids(n, model.config.vocab_size)])

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
    from tests.family_models import FAMILY_SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument(
        "--family",
        default="gemma2",
        choices=[*FAMILY_SHAPES, "none"],
        help="tiny checkpoint of tests/family_models.py for the second section",
    )
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
    rows = compare(llm, hf, (128, 512, 2048), (1, 8, 32), args.decode_steps, 5,
                   prefill_ceiling, decode_floor_s)  # fmt: skip
    model = llm.engine.model
    twins = [t for layer in model.layers for t in layer.panels.values()]
    twins += [model.lm_head_panels] if model.lm_head_panels is not None else []
    streamed = sum(t.panels.nbytes for t in twins)
    print(
        f"decode streams {streamed / 1e6:.0f} MB of packed weights a step (the GGUF's Q4_1 / "
        f"Q8_0 blocks where its floats are exactly those); floor from those bytes "
        f"{streamed / bandwidth * 1e3:.1f} ms; the floors above count float32 weights"
    )
    _table(rows, "distance from floor")
    if args.family != "none":
        print(f"\nsecond family: tiny {args.family} (tests/family_models.py)", flush=True)
        _table(family_rows(args.family, args.decode_steps, 5), "step")


def compare(
    llm,
    hf,
    prefills,
    batches,
    steps: int,
    repeats: int,
    prefill_ceiling: float | None = None,
    decode_floor_s: float | None = None,
) -> list:
    """Rows (name, pdserve tok/s, HF tok/s, note) of prefills of ``prefills`` tokens and
    decodes of ``batches`` requests, best of ``repeats`` alternating runs each; the note
    is the distance from the ceiling or floor when given, else the decode step time."""
    rows = []
    for n in prefills:
        t_ours, t_theirs = alternating_best([engine_prefill(llm, n), hf_prefill(hf, n)], repeats)
        ours, theirs = n / t_ours, n / t_theirs
        note = "" if prefill_ceiling is None else f"{ours / prefill_ceiling:.0%} of ceiling"
        rows.append((f"prefill {n}", ours, theirs, note))
        print(_fmt(rows[-1]), flush=True)
    for b in batches:
        ours, theirs = 0.0, 0.0
        for run in range(repeats):
            ours = max(ours, engine_decode(llm, b, steps, run))
            theirs = max(theirs, hf_decode(hf, b, steps))
        step_ms = b / ours * 1e3
        note = f"{step_ms:.1f} ms/step"
        if decode_floor_s is not None:
            note = f"{step_ms / (decode_floor_s * 1e3):.2f}x floor ({note})"
        rows.append((f"decode batch {b}", ours, theirs, note))
        print(_fmt(rows[-1]), flush=True)
    return rows


def family_rows(family: str, steps: int, repeats: int, prefills=(128, 512), batches=(1, 8)):
    """``compare`` on the tiny random checkpoint ``family`` of tests/family_models.py
    (float32), written to a temporary folder; first a line naming the decode path."""
    from transformers import AutoModelForCausalLM

    from tests.family_models import save_tiny_family

    with tempfile.TemporaryDirectory() as folder:
        save_tiny_family(Path(folder), family)
        llm = LLM(folder, num_kv_blocks=1024, max_batch_tokens=2048, max_batch_size=64)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        fast = llm.engine.model.cpu_decode is not None
        print(f"decode path: {'C decode layers' if fast else 'per-op torch layers'}")
        return compare(llm, hf, prefills, batches, steps, repeats)


def _table(rows, note: str) -> None:
    print(f"\n| | pdserve tok/s | HF tok/s | ratio | {note} |")
    print("|---|---|---|---|---|")
    for name, ours, theirs, text in rows:
        print(f"| {name} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x | {text} |")


def _fmt(row):
    name, ours, theirs, floor = row
    ratio = ours / theirs
    return f"{name:>16}: pdserve {ours:7.0f} tok/s  HF {theirs:7.0f} tok/s  x{ratio:.2f}  {floor}"


if __name__ == "__main__":
    main()
