"""Engine vs HF transformers on the embedded model (float32, 2 threads), on each CPU ISA
the kernels can run here, next to the machine's floors and ceilings measured in the
same run, then on a second family's tiny checkpoint.

    .venv/bin/python -m pdserve.bench.engine [--isa avx2,avx512] [--threads 2] [--decode-steps 16]
                                     [--family gemma2|none] [--json results.json]

Each ISA (default: every one of engine/native.py the CPU has) runs in a process of its
own with ``PDSERVE_CPU_ISA`` set, and HF transformers beside it on the same instruction
set: for AVX2, torch's ATen, MKL and oneDNN are capped to AVX2 too
(``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``), so the
AVX2 rows are what an AVX2-only machine of this clock and memory would show.

Prefill: one prompt of 128 / 512 / 2048 tokens in one pass (HF computes the last logit
only), a prompt no pass has seen (and prefix caching off), after a warm-up pass each,
best of 5 passes that alternate between the engine and HF. Decode: batch 1 / 8 / 32 of
128-token contexts, tokens/s over N steps, best of 5 runs that alternate the same way.
The machine is shared: a single run of either can land on a busy moment, and
alternating gives both sides the same chances.

Limits (bench/limits.py), measured in the same process: a prefill pass cannot beat the
FMA peak of the ISA's vectors over its multiply-adds (projections and attention), and a
decode step cannot beat reading its packed weights and KV at the copy bandwidth nor
its multiply-adds at that peak. A figure past its limit is a broken measurement (a
cache hit counted as a prefill): the bench says so and stops, printing nothing of it.

The second section (``--family``, a name of tests/family_models.py, default Gemma 2;
``none`` skips it) runs prefill 128 / 512 and decode batch 1 / 8 the same way on that
family's tiny random checkpoint (hidden 64). Gemma 2, Gemma 3, Qwen2 and Qwen3 decode on
the per-op torch layers, not the embedded Llama's C decode layers (docs/models.md, "The
C decode fast path"); at this size a step is nearly all per-op overhead, so a
regression in that generic path shows as a drop of its ratio to HF.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.limits import Limits, cpu_summary
from pdserve.engine import LLM, SamplingParams, native
from pdserve.engine.checkpoint import resolve
from pdserve.planner.floors import best_of

MODEL = "smollm2-135m"
# what caps torch, MKL and oneDNN (HF transformers' kernels) to an ISA's instructions
LIBRARY_CAPS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "avx512": {},
    "amx": {},
}


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """A prefill prompt of n tokens, ids in [100, vocab) (vocab > 100); each seed gives a
    prompt whose first token differs from every other seed's, so no two share a block."""
    span = min(40000, vocab - 100)
    return [(7 * i + 13 * seed) % span + 100 for i in range(n)]


def engine_prefill(llm: LLM, n: int):
    """A function that runs one prefill of n tokens, a new prompt each call."""
    vocab, params, calls = llm.engine.model_config.vocab_size, SamplingParams(max_tokens=1), [0]

    def run():
        calls[0] += 1
        llm.generate(prompt_ids(n, vocab, calls[0]), params)

    return run


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
    """A function that runs HF's prefill of n tokens (logits of the last only)."""
    vocab, calls = model.config.vocab_size, [0]

    def run():
        calls[0] += 1
        with torch.inference_mode():
            model(torch.tensor([prompt_ids(n, vocab, calls[0])]), logits_to_keep=1)

    return run


def alternating_best(fns: list, repeats: int) -> list[float]:
    """Each function's shortest wall time in seconds, over ``repeats`` rounds that call
    them in turn (after one warm-up call each)."""
    best = [best_of(fn, repeats=1) for fn in fns]
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


def compare(llm, hf, prefills, batches, steps: int, repeats: int, limits: Limits | None = None):
    """Rows (name, pdserve tok/s, HF tok/s, note) of prefills of ``prefills`` tokens and
    decodes of ``batches`` requests, best of ``repeats`` alternating runs each; with
    ``limits``, each figure checked against them (``Limits.check`` stops the bench on
    an impossible one) and the note its distance from them, else the decode step time."""
    rows = []
    for n in prefills:
        t_ours, t_theirs = alternating_best([engine_prefill(llm, n), hf_prefill(hf, n)], repeats)
        ours, theirs = n / t_ours, n / t_theirs
        note = ""
        if limits is not None:
            ceiling = limits.prefill_ceiling(n)
            limits.check(f"prefill {n}", [("pdserve", ours), ("HF", theirs)], ceiling)
            note = f"{ours / ceiling:.0%} of ceiling {ceiling:.0f}"
        rows.append((f"prefill {n}", ours, theirs, note))
        print(_fmt(rows[-1]), flush=True)
    for b in batches:
        ours, theirs = 0.0, 0.0
        for run in range(repeats):
            ours = max(ours, engine_decode(llm, b, steps, run))
            theirs = max(theirs, hf_decode(hf, b, steps))
        step_ms = b / ours * 1e3
        note = f"{step_ms:.1f} ms/step"
        if limits is not None:
            floor_s = limits.decode_floor_s(b, context=128 + steps)
            limits.check(f"decode batch {b}", [("pdserve", ours), ("HF", theirs)], b / floor_s)
            note = f"{step_ms / (limits.q4_floor_s * 1e3):.2f}x Q4 floor ({note})"
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


def run_isa(args) -> dict:
    """This process's ISA (PDSERVE_CPU_ISA): the tables, and what they hold."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    isa = native.isa()
    print(cpu_summary())
    print(
        f"kernels: {isa} (this CPU has {', '.join(native.supported())}); HF's torch: "
        f"{torch.backends.cpu.get_cpu_capability()}, threads {args.threads}"
    )
    llm = LLM(
        MODEL,
        num_kv_blocks=1024,
        max_batch_tokens=2048,
        max_batch_size=64,
        enable_prefix_caching=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(resolve(MODEL), dtype=torch.float32).eval()
    limits = Limits.measure(llm.engine.model, isa, args.threads)
    print(limits.describe())
    rows = compare(llm, hf, (128, 512, 2048), (1, 8, 32), args.decode_steps, 5, limits)
    _table(rows, f"{isa}: distance from the limits")
    result = {"isa": isa, "rows": rows, "limits": limits.describe()}
    if args.family != "none":
        print(f"\nsecond family: tiny {args.family} (tests/family_models.py), {isa}", flush=True)
        result["family"] = family_rows(args.family, args.decode_steps, 5)
        _table(result["family"], "step")
    return result


def main() -> None:
    from tests.family_models import FAMILY_SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--isa", default=None, help="comma-separated ISAs (default: every one here)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument(
        "--family",
        default="gemma2",
        choices=[*FAMILY_SHAPES, "none"],
        help="tiny checkpoint of tests/family_models.py for the second section",
    )
    ap.add_argument("--json", type=Path, default=None, help="write every ISA's rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one ISA, here
    args = ap.parse_args()
    if args.child:
        result = run_isa(args)
        args.json.write_text(json.dumps(result))
        return
    isas = args.isa.split(",") if args.isa else native.supported()
    for isa in isas:
        if isa not in native.supported():
            ap.error(f"--isa {isa}: this CPU runs {', '.join(native.supported())}")
    results = []
    for isa in isas:
        print(f"\n=== {isa} ===", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            env = {**os.environ, native.ENV: isa, **LIBRARY_CAPS[isa]}
            argv = [
                sys.executable,
                "-m",
                "pdserve.bench.engine",
                "--child",
                "--json",
                out.name,
                "--threads",
                str(args.threads),
                "--decode-steps",
                str(args.decode_steps),
                "--family",
                args.family,
            ]
            subprocess.run(argv, env=env, check=True)
            results.append(json.loads(Path(out.name).read_text()))
    print("\n=== every ISA: pdserve / HF on the same ISA ===")
    print("| | " + " | ".join(r["isa"] for r in results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for i, row in enumerate(results[0]["rows"]):
        cells = [f"{r['rows'][i][1] / r['rows'][i][2]:.2f}x" for r in results]
        print(f"| {row[0]} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


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
