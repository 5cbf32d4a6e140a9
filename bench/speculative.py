"""Speculative decoding (engine/speculative.py) with each guesser (engine/guessers.py:
ngram, suffix) against the same engine without it, in one run, on the embedded model,
greedy:

    .venv/bin/python -m pdserve.bench.speculative [--tokens 128] [--k 2] [--rounds 3] \
        [--batches 1,16] [--llama-cpp-venv PATH]

Workloads: ``repeat``, HumanEval problems the model is asked to repeat with comments
(its answer copies long spans of the prompt: where drafts hold), and ``chat``, ShareGPT
first turns (where they mostly do not). Each at batch 1 (the first problem or turn)
and 16 (the first 16; ``--batches``), best of ``--rounds`` alternating rounds; each
round of ``suffix`` starts with no counts from earlier requests (the rounds repeat the
same prompts, whose outputs it would otherwise guess whole). Reported per cell: decode
tokens a second (output tokens after each request's first, over the steps after the
last prompt was computed), the ratio to the plain engine, and tokens per request-step.
Checks: the outputs are the plain engine's, token for token (greedy), and a speculative
step never yields fewer tokens than a plain one. With ``--llama-cpp-venv`` (a venv
where llama-cpp-python imports), llama.cpp on the GGUF file runs each workload's
batch-1 prompt alone and with its prompt-lookup decoding (bench/speculative_llama_cpp.py,
a process of its own), the ratio printed only where the two outputs are equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from pdserve.engine import LLM, SamplingParams, native
from pdserve.engine.checkpoint import alias_path
from pdserve.engine.guessers import GUESSERS, make_guesser
from pdserve.loadgen.datasets import humaneval_pairs, sharegpt_pairs

MODEL = "smollm2-135m"
LLAMA_CPP = Path(__file__).with_name("speculative_llama_cpp.py")


def workloads(llm: LLM) -> dict[str, list[str]]:
    """Chat-templated prompts of each workload, 16 each."""

    def chat(text: str) -> str:
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])

    repeat = [
        chat("Repeat this code exactly, with a comment on each line:\n" + prompt)
        for prompt, _ in humaneval_pairs()[:16]
    ]
    talk = [chat(turn[:2000]) for turn, _ in sharegpt_pairs(limit=16)]
    return {"repeat": repeat, "chat": talk}


def decode(llm: LLM, prompts: list[str], tokens: int) -> tuple[list, float, int]:
    """The outputs of ``prompts``, the seconds of the steps after every prompt was
    computed, and the request-steps in them."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    seconds, request_steps = 0.0, 0
    while engine.has_unfinished_requests():
        prefilling = engine.has_prompts_to_compute()
        start = time.perf_counter()
        outs = engine.step()
        if not prefilling:
            seconds += time.perf_counter() - start
            request_steps += len({o.request_id for o in outs})
        for o in outs:
            got[o.request_id] += o.new_token_ids
    engine.check_integrity()
    return [got[f"r{i}"] for i in range(len(prompts))], seconds, request_steps


def rows_ms(llm: LLM, rows: tuple[int, ...] = (1, 2, 3, 5, 8)) -> dict[int, float]:
    """Median ms of a plain greedy decode step of ``rows`` requests at ~300 tokens of
    context: what verifying that many rows of one greedy request costs."""
    engine, out = llm.engine, {}
    for b in rows:
        for i in range(b):
            prompt = [100 + (i + j) % 50 for j in range(300)]
            params = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
            engine.add_request(f"w{i}", prompt, params)
        times = []
        while engine.has_unfinished_requests():
            prefilling = engine.has_prompts_to_compute()
            start = time.perf_counter()
            engine.step()
            if not prefilling:
                times.append(time.perf_counter() - start)
        out[b] = statistics.median(times) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens per request")
    ap.add_argument("--k", type=int, default=2, help="guessed tokens a step verifies")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per cell (best of)")
    ap.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    ap.add_argument("--llama-cpp-venv", type=Path, help="a venv where llama_cpp imports")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain = LLM(MODEL, enable_prefix_caching=False)
    guessing = {
        name: LLM(MODEL, enable_prefix_caching=False, speculative_tokens=args.k,
                  speculative_method=name)
        for name in GUESSERS
    }  # fmt: skip
    print(
        f"{MODEL}, {args.threads} threads, {native.isa() or 'plain torch'} kernels, greedy, "
        f"max_tokens {args.tokens}, k={args.k}"
    )
    for name, prompts in workloads(plain).items():
        for batch in map(int, args.batches.split(",")):
            cell = prompts[:batch]
            rates: dict[str, tuple] = {}
            for r in range(args.rounds):  # alternating, the best of each
                for label, llm in (("plain", plain), *guessing.items()):
                    decode(llm, cell[:1], 4)  # warm-up
                    llm.engine.guesser = make_guesser(llm.engine.config.speculative_method)
                    outs, seconds, steps = decode(llm, cell, args.tokens)
                    emitted = sum(max(0, len(o) - 1) for o in outs)  # after each first token
                    best = rates.get(label, (None, 0.0, 0.0))[1]
                    if emitted / seconds > best:
                        rates[label] = (outs, emitted / seconds, emitted / max(steps, 1))
                print(f"  {name} batch {batch}: round {r + 1}/{args.rounds}", flush=True)
            want, base, _ = rates["plain"]
            line = f"{name:>6} batch {batch:>2}: plain {base:7.1f} tok/s"
            for method in guessing:
                got, rate, per_step = rates[method]
                if got != want:
                    raise SystemExit(f"{name} batch {batch}: {method}'s output differs from plain")
                if per_step < 1:
                    raise SystemExit(f"{name} batch {batch}: {per_step:.2f} tokens a step, below 1")
                line += f", {method} {rate:7.1f} ({rate / base:.2f}x, {per_step:.2f} a step)"
            print(line)

    cost = ", ".join(f"{b}: {ms:.2f}" for b, ms in rows_ms(plain).items())
    print(f"a plain decode step by rows (ms): {cost}")
    if args.llama_cpp_venv is None:
        print("llama.cpp skipped: no --llama-cpp-venv given")
    else:
        # the same token ids (the chat template's text as the engine encodes it)
        cells = {name: plain.tokenizer.encode(p[0]) for name, p in workloads(plain).items()}
        llama_cpp(args, cells)


def llama_cpp(args: argparse.Namespace, cells: dict[str, list[int]]) -> None:
    """llama.cpp alone and with its prompt lookup on each batch-1 prompt (module
    docstring), printed; a ratio only where the two outputs are equal."""
    python = str(args.llama_cpp_venv / "bin" / "python")
    command = [python, "-P", str(LLAMA_CPP), "--model", str(alias_path(MODEL))]
    command += ["--k", str(args.k), "--tokens", str(args.tokens), "--rounds", str(args.rounds)]
    command += ["--threads", str(args.threads)]
    print("  llama.cpp: running its driver", flush=True)
    done = subprocess.run(command, input=json.dumps(cells), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp driver failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    print(f"llama.cpp {result['version']}, {result['threads']} threads, Q4_1 GGUF, k={args.k}:")
    for name, cell in result["cells"].items():
        line = f"{name:>6} batch  1: plain {cell['plain']:7.1f} tok/s, lookup "
        if cell["same"]:
            line += f"{cell['lookup']:7.1f} ({cell['lookup'] / cell['plain']:.2f}x)"
        else:  # not the same tokens: its rate is not comparable
            line += "output differs from its plain output (no ratio)"
        print(line)


if __name__ == "__main__":
    main()
