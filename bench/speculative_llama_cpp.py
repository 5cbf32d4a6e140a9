"""llama.cpp's prompt-lookup decoding beside ``bench/speculative.py``: run in a venv where
``llama_cpp`` (llama-cpp-python) imports, with ``-P``, by that bench's
``--llama-cpp-venv``:

    <venv>/bin/python -P bench/speculative_llama_cpp.py --model FILE.gguf --k 2 \\
        --tokens 128 --rounds 3 --threads 2 < cells.json

stdin: ``{"<workload>": [prompt token ids], ...}`` (one prompt a workload: llama-cpp-
python's ``Llama`` decodes one sequence). For each, greedy, ``--tokens`` tokens never
stopping at the end of text, best of ``--rounds`` alternating rounds: llama.cpp alone,
and llama.cpp with ``LlamaPromptLookupDecoding(num_pred_tokens=k)`` as its draft model
(which makes it keep every position's logits, as verifying needs). Decode tokens a
second: the tokens after the first over the time after the first. stdout: one JSON
object, ``{"version", "threads", "cells": {"<workload>": {"plain", "lookup" (tokens a
second), "same" (the two outputs equal)}}}``. At module level it imports the standard
library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def decode(llm, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedy output of ``tokens`` tokens and its decode rate (after the first token)."""
    out: list[int] = []
    first = 0.0
    for token in llm.generate(prompt, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) == 1:
            first = time.perf_counter()
        if len(out) == tokens:
            break
    return out, (tokens - 1) / (time.perf_counter() - first)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--k", type=int, default=2, help="tokens a lookup proposes")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = dict(n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads)
    engines = {
        "plain": llama_cpp.Llama(model_path=args.model, verbose=False, **common),
        "lookup": llama_cpp.Llama(
            model_path=args.model,
            verbose=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.k),
            **common,
        ),
    }
    cells = {}
    for name, prompt in json.load(sys.stdin).items():
        best = {label: ([], 0.0) for label in engines}
        for llm in engines.values():
            decode(llm, prompt, 4)  # warm-up
        for _ in range(args.rounds):
            for label, llm in engines.items():
                out, rate = decode(llm, prompt, args.tokens)
                if rate > best[label][1]:
                    best[label] = (out, rate)
        cells[name] = {
            "plain": best["plain"][1],
            "lookup": best["lookup"][1],
            "same": best["plain"][0] == best["lookup"][0],
        }
    json.dump(
        {"version": llama_cpp.__version__, "threads": args.threads, "cells": cells}, sys.stdout
    )


if __name__ == "__main__":
    main()
