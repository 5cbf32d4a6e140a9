"""What structured outputs cost on the embedded model (engine/structured.py): the decode
step with guided requests in the batch against the same batch unguided, in the same run,
and the compile time of a guide.

    .venv/bin/python -m pdserve.bench.structured [--steps 48] [--rounds 5] [--threads 2]

Step time: a batch of B requests (B = 1 and 32) decodes ``--steps`` tokens after its
prefill; the median step of each mix, best of ``--rounds`` rounds that alternate the
mixes: none guided (the baseline), half guided, all guided; the noise is the spread of
the baseline's rounds (slowest less fastest), and each mix's extra time is said to be
within it or past it. A guided request's guide is
a JSON schema of 40 objects of two fields (a long, branching grammar: every step of it
computes a real mask). The cost is the step's extra time over the baseline; the mask
itself (``Matcher.fill``) is timed alone too, along the guided outputs, and so is the
sampler. Checks: every guided output is a prefix of a document the schema accepts
(greedy, at most ``--steps`` tokens: the grammar holds mid-document), and a cached
compile is faster than a fresh one.

Compile: each guide of ``GUIDES`` compiled fresh (a new ``Grammars``, the tokenizer
built once), then fetched from the cache (a copy per request).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.engine import LLM, SamplingParams, native
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.structured import Grammars, Guide, llg_tokenizer

MODEL = "smollm2-135m"
ITEM = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 8}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}
LONG = Guide("json", json.dumps({"type": "array", "items": ITEM, "minItems": 40, "maxItems": 40}))
GUIDES = {
    "json_object": Guide("json", '{"type": "object"}'),
    "flat schema, 4 fields": Guide(
        "json",
        json.dumps(
            {
                "type": "object",
                "required": ["a", "b", "c", "d"],
                "additionalProperties": False,
                "properties": {
                    "a": {"type": "string"},
                    "b": {"type": "integer"},
                    "c": {"enum": ["x", "y", "z"]},
                    "d": {"type": "boolean"},
                },
            }
        ),
    ),
    "nested, 40-item array": LONG,
    "wide schema, 50 fields": Guide(
        "json",
        json.dumps(
            {
                "type": "object",
                "additionalProperties": False,
                "required": [f"f{i}" for i in range(50)],
                "properties": {f"f{i}": {"type": ["string", "integer", "null"]} for i in range(50)},
            }
        ),
    ),
    "regex": Guide("regex", r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}, [0-9]{5}"),
    "choice of 20": Guide("choice", json.dumps([f"option-{i}" for i in range(20)])),
}


def step_ms(llm: LLM, batch: int, guided: int, steps: int) -> tuple[float, list]:
    """Median ms of a decode step of ``batch`` requests, the first ``guided`` of them
    guided by ``LONG``; their final outputs."""
    engine = llm.engine
    for i in range(batch):
        params = SamplingParams(
            max_tokens=steps + 1, temperature=0, ignore_eos=True, guide=LONG if i < guided else None
        )
        engine.add_request(f"r{i}", [100 + (i + j) % 50 for j in range(64)], params)
    ends: dict = {}
    times = []
    while engine.has_unfinished_requests():
        prefilling = engine.has_prompts_to_compute()
        t = time.perf_counter()
        outs = engine.step()
        if not prefilling:
            times.append(time.perf_counter() - t)
        for o in outs:
            if o.finished:
                ends[o.request_id] = o
    engine.check_integrity()
    return statistics.median(times) * 1e3, [ends[f"r{i}"] for i in range(guided)]


def held(out, grammars: Grammars) -> bool:
    """Whether a guided output is the start of a document ``LONG`` accepts: it opens the
    array's first object, and a matcher of its own (not the engine's) takes its tokens."""
    matcher = grammars.matcher(LONG)
    ok = matcher.inner.consume_tokens(list(out.token_ids))
    return out.text.startswith('[{"id": ') and ok and matcher.error is None


def mask_us(llm: LLM, outputs: list) -> tuple[float, float]:
    """Microseconds of one mask of ``LONG``'s matcher (median, mean) at each position of
    the engine's own guided ``outputs``: the masks their steps computed."""
    grammars = llm.engine.grammars()
    bits = torch.empty((llm.engine.model_config.vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for out in outputs:
        matcher = grammars.matcher(LONG)
        for token in out.token_ids:
            t = time.perf_counter()
            matcher.fill(bits)
            times.append(time.perf_counter() - t)
            matcher.consume(token)
    return statistics.median(times) * 1e6, statistics.fmean(times) * 1e6


def sampler_us(llm: LLM, batch: int = 32, guided: int = 16, loops: int = 50) -> dict:
    """Microseconds of the sampler alone (median of ``loops``) on random logits for
    ``batch`` greedy requests, none guided and ``guided`` of them guided (each matcher at
    ``LONG``'s start: its mask is cheap, so this is the sampler's own part)."""
    vocab, grammars = llm.engine.model_config.vocab_size, llm.engine.grammars()
    logits, sampler = torch.randn(batch, vocab), Sampler()
    out = {}
    for n in (0, guided):
        requests = [
            Request(f"s{i}", [1, 2, 3], SamplingParams(temperature=0)) for i in range(batch)
        ]
        for r in requests[:n]:
            r.matcher = grammars.matcher(LONG)
        times = []
        for _ in range(loops):
            t = time.perf_counter()
            sampler(logits, requests)
            times.append(time.perf_counter() - t)
        out[n] = statistics.median(times) * 1e6
    return out


def compile_ms(llm: LLM) -> dict[str, tuple[float, float]]:
    """Per guide: ms of a fresh compile, µs of a cached fetch and copy."""
    tokenizer = llg_tokenizer(llm.engine.tokenizer, llm.engine.model_config.vocab_size)
    out = {}
    for name, guide in GUIDES.items():
        grammars = Grammars(tokenizer)
        start = time.perf_counter()
        grammars.compile(guide)
        fresh = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        grammars.matcher(guide)
        cached = (time.perf_counter() - start) * 1e6
        if cached / 1e3 >= fresh:
            raise SystemExit(f"{name}: a cached guide ({cached:.0f} µs) took a compile's time")
        out[name] = (fresh, cached)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(MODEL, enable_prefix_caching=False)
    checker = Grammars(llg_tokenizer(llm.engine.tokenizer, llm.engine.model_config.vocab_size))
    print(
        f"{MODEL}, {args.threads} threads, {native.isa() or 'plain torch'} kernels, "
        f"{args.steps} decode steps, best of {args.rounds}"
    )
    step_ms(llm, 1, 1, 4)  # warm-up, the guide compiled
    for batch in (1, 32):
        mixes = (
            {"none": 0, "half": batch // 2, "all": batch} if batch > 1 else {"none": 0, "all": 1}
        )
        rounds: dict[str, list[float]] = {m: [] for m in mixes}
        for r in range(args.rounds):
            for mix, guided in mixes.items():
                ms, outs = step_ms(llm, batch, guided, args.steps)
                rounds[mix].append(ms)
                guided_outputs = outs
                bad = [o.text for o in outs if not held(o, checker)]
                if bad:
                    raise SystemExit(f"a guided output left its grammar: {bad[0][:80]!r}")
            print(f"  batch {batch}: round {r + 1}/{args.rounds}", flush=True)
        best = {mix: min(times) for mix, times in rounds.items()}
        base, noise = best["none"], max(rounds["none"]) - best["none"]
        print(f"batch {batch:>2}: the unguided batch's rounds spread {noise:.2f} ms (the noise)")
        for mix, guided in mixes.items():
            extra = best[mix] - base
            within = "within the noise" if extra <= noise else "past the noise"
            print(
                f"batch {batch:>2}, {guided:>2} guided: {best[mix]:7.2f} ms/step ({extra:+.2f} "
                f"ms, {best[mix] / base:.3f}x the unguided batch, {within})"
            )
    median, mean = mask_us(llm, guided_outputs)
    print(
        f"one mask of the 40-item schema along the outputs: {median:.0f} µs median, "
        f"{mean:.0f} µs mean"
    )
    alone = sampler_us(llm)
    print(
        f"the sampler alone, 32 greedy rows: {alone[0]:.0f} µs none guided, "
        f"{alone[16]:.0f} µs with 16 guided"
    )
    print("compile per guide (fresh ms / cached copy µs):")
    for name, (fresh, cached) in compile_ms(llm).items():
        print(f"  {name:>24}: {fresh:8.2f} ms / {cached:6.0f} µs")


if __name__ == "__main__":
    main()
