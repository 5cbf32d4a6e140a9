"""Tensor-parallel step time and all-reduce cost on CPU (gloo), for the planner's cost model.

    .venv/bin/python -m pdserve.bench.tp [--model smollm2-135m] [--degrees 1,3]
                                 [--prompt-tokens 512]
                                 [--batches 1,8] [--steps 20] [--calls 200]

For each degree (degree 1, the baseline, always runs first):

step   the engine's per-step time through the offline API, ``LLM(..., tensor_parallel=N)``
       with ranks 1..N-1 spawned by the engine: ``engine.step()`` timed on rank 0, the
       median after warm-up steps, for a prefill step (one --prompt-tokens prompt in one
       pass) and decode steps at each --batches size (128-token contexts).
comm   in a gloo world of the same degree (ranks spawned here, ``serve_store`` and
       ``TensorParallel.join``), the median time per call of ``TensorParallel.all_reduce``
       on what a layer all-reduces ([tokens, hidden] float32, after O and after down),
       and of the step's other collectives: the step plan's two broadcasts and the
       logits gather.

    all-reduce per layer = 2 x per call;  per step = layers x per layer;  share = per step / step

The comm figures come from a world doing nothing else, so the share is what the
collectives would cost with no compute in their way. One JSON line at the end carries
every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import time

import torch

from pdserve.engine.checkpoint import load_checkpoint
from pdserve.engine.parallel import TensorParallel, check_degree, serve_store
from pdserve.engine.step_plan import HEADER
from pdserve.engine.tp_rank import threads_per_rank

CONTEXT = 128  # prompt tokens of each decoding sequence
DTYPES = {"float32": torch.float32, "int64": torch.int64}


def scenarios(prompt_tokens: int, batches: list[int]) -> list[tuple[str, int, int, int]]:
    """(name, tokens in the step, sequences, context length of each)."""
    out = [(f"prefill {prompt_tokens}", prompt_tokens, 1, prompt_tokens)]
    return out + [(f"decode b{b}", b, b, CONTEXT) for b in batches]


def comm_cases(cfg, degree: int, scenario, block_size: int) -> list[tuple[str, str, tuple, str]]:
    """The collectives of one step of ``scenario``: (key, op, shape, dtype)."""
    name, t, b, ctx = scenario
    width = math.ceil((ctx + 1) / block_size)  # block-table width
    payload = 3 * t + 2 * b + 1 + b * width + b  # engine/step_plan.py, one sampled row a seq
    cases = [
        (f"{name}/allreduce", "all_reduce", (t, cfg.hidden_size), "float32"),
        (f"{name}/header", "broadcast", (HEADER,), "int64"),
        (f"{name}/payload", "broadcast", (payload,), "int64"),
    ]
    if cfg.vocab_size % degree == 0:  # vocab-parallel LM head: logits gathered
        cases.append((f"{name}/gather", "all_gather", (b, cfg.vocab_size // degree), "float32"))
    return cases


def time_calls(fn, calls: int, warmup: int) -> float:
    """Median ms of ``calls`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure_comm(tp: TensorParallel, cases, calls: int) -> dict[str, float]:
    """Every rank runs the same cases in the same order; returns this rank's medians."""
    out = {}
    for key, op, shape, dtype in cases:
        x = torch.zeros(shape, dtype=DTYPES[dtype])  # zeros: repeated sums stay finite
        fn = {
            "all_reduce": lambda x=x: tp.all_reduce(x),
            "broadcast": lambda x=x: tp.broadcast(x),
            "all_gather": lambda x=x: tp.all_gather_last_dim(x),
        }[op]
        out[key] = time_calls(fn, calls, warmup=max(5, calls // 10))
    return out


def _comm_rank(address: str, rank: int, size: int, cases, calls: int) -> None:
    torch.set_num_threads(threads_per_rank(size))
    measure_comm(TensorParallel.join(address, rank, size), cases, calls)


def comm_world(degree: int, cases, calls: int) -> dict[str, float]:
    """Rank 0's medians in a fresh gloo world of ``degree`` local processes."""
    _store, address = serve_store()  # kept alive until the world is done
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_comm_rank, args=(address, r, degree, cases, calls), daemon=True)
        for r in range(1, degree)
    ]
    for p in procs:
        p.start()
    try:
        torch.set_num_threads(threads_per_rank(degree))
        return measure_comm(TensorParallel.join(address, 0, degree), cases, calls)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def step_times(model: str, degree: int, args, scens) -> dict[str, float]:
    """Median ms of ``engine.step()`` on rank 0 for each scenario."""
    from pdserve.engine import LLM, SamplingParams

    # LLM(tensor_parallel=N) sets this itself (and leaves it set); degree 1 does not
    torch.set_num_threads(threads_per_rank(degree))
    out, max_batch_tokens = {}, max(512, args.prompt_tokens)
    with LLM(
        model,
        num_kv_blocks=args.kv_blocks,
        max_batch_tokens=max_batch_tokens,
        max_batch_size=max(64, *args.batches),
        tensor_parallel=degree,
    ) as llm:
        e = llm.engine
        vocab = e.model_config.vocab_size

        def ids(n: int, seed: int) -> list[int]:
            return [3 + (7 * i + 13 * seed) % (vocab - 3) for i in range(n)]

        name, n = scens[0][0], scens[0][1]
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        times = []
        for i in range(args.warmup + args.prefill_repeats):
            e.add_request(f"p{i}", ids(n, i), one)
            t = time.perf_counter()
            done = e.step()
            times.append(time.perf_counter() - t)
            if not (done and done[0].finished):
                raise RuntimeError(f"{name}: the prompt did not prefill in one step")
        out[name] = statistics.median(times[args.warmup :]) * 1e3
        print(f"  degree {degree}  {name:>12}: {out[name]:8.1f} ms/step", flush=True)

        for name, _, b, ctx in scens[1:]:
            # the first prompts decode while later ones prefill: room for those steps too
            ahead = math.ceil(b * ctx / max_batch_tokens) + 2
            params = SamplingParams(
                max_tokens=args.warmup + args.steps + ahead, temperature=0, ignore_eos=True
            )
            for i in range(b):
                e.add_request(f"{name}-{i}", ids(ctx, 100 + i), params)
            while any(r.num_output_tokens == 0 for r in e.requests.values()):
                e.step()  # the prompts' prefill, chunked by max_batch_tokens
            times = []
            for _ in range(args.warmup + args.steps):
                t = time.perf_counter()
                done = e.step()
                times.append(time.perf_counter() - t)
                if len(done) != b:
                    raise RuntimeError(f"{name}: {len(done)} tokens from a batch of {b}")
            for request_id in list(e.requests):
                e.abort_request(request_id)
            out[name] = statistics.median(times[args.warmup :]) * 1e3
            print(f"  degree {degree}  {name:>12}: {out[name]:8.1f} ms/step", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="alias, HF folder or .gguf file")
    p.add_argument("--degrees", default="1,3", help="tensor-parallel degrees (1 always runs)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens of the prefill step")
    p.add_argument("--batches", default="1,8", help="decode batch sizes")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    p.add_argument("--prefill-repeats", type=int, default=5, help="timed prefill steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each timing")
    p.add_argument("--calls", type=int, default=200, help="timed calls per collective")
    p.add_argument("--kv-blocks", type=int, default=256)
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    degrees = sorted({1, *(int(d) for d in args.degrees.split(","))})

    cfg = load_checkpoint(args.model).config
    for d in degrees:
        check_degree(cfg, d, "--degrees")
    scens = scenarios(args.prompt_tokens, args.batches)
    block_size = 16  # LLM's default, which step_times uses
    load_start = os.getloadavg()
    print(
        f"model {args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}; cpus {os.cpu_count()}, torch {torch.__version__}, "
        f"load average {load_start[0]:.2f}",
        flush=True,
    )

    steps, comm = {}, {}
    for d in degrees:
        print(f"degree {d}: engine steps ...", flush=True)
        steps[d] = step_times(args.model, d, args, scens)
        cases = [c for s in scens for c in comm_cases(cfg, d, s, block_size)]
        if d == 1:
            comm[d] = {key: 0.0 for key, *_ in cases}  # every collective is a no-op
            continue
        print(f"degree {d}: collectives, {args.calls} calls each ...", flush=True)
        comm[d] = comm_world(d, cases, args.calls)
        for key, ms in comm[d].items():
            print(f"  degree {d}  {key:>24}: {ms * 1e3:8.1f} us/call", flush=True)
    load_end = os.getloadavg()

    rows = []
    for d in degrees:
        for name, tokens, *_ in scens:
            c = comm[d]
            per_call = c[f"{name}/allreduce"]
            per_step = 2 * cfg.num_layers * per_call
            others = c[f"{name}/header"] + c[f"{name}/payload"] + c.get(f"{name}/gather", 0)
            rows.append(
                {
                    "degree": d,
                    "step": name,
                    "tokens": tokens,
                    "step_ms": steps[d][name],
                    "vs_degree1": steps[d][name] / steps[1][name],
                    "allreduce_ms_per_call": per_call,
                    "allreduce_ms_per_layer": 2 * per_call,
                    "allreduce_ms_per_step": per_step,
                    "allreduce_share": per_step / steps[d][name],
                    "plan_and_gather_ms_per_step": others,
                }
            )
    print(
        f"\nload average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end "
        f"({os.cpu_count()} cpus)\n\n"
        "| degree | step | step ms | vs degree 1 | all-reduce ms/call | all-reduce ms/layer "
        "| all-reduce ms/step | all-reduce share | plan + gather ms/step |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['degree']} | {r['step']} | {r['step_ms']:.1f} | {r['vs_degree1']:.2f}x "
            f"| {r['allreduce_ms_per_call']:.3f} | {r['allreduce_ms_per_layer']:.3f} "
            f"| {r['allreduce_ms_per_step']:.1f} | {r['allreduce_share']:.0%} "
            f"| {r['plan_and_gather_ms_per_step']:.2f} |"
        )
    summary = {
        "bench": "tp",
        "model": args.model,
        "layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "cpus": os.cpu_count(),
        "load_average": [round(load_start[0], 2), round(load_end[0], 2)],
        "rows": [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows
        ],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
