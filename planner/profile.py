"""``pdserve profile CONFIG``: this machine's step times with the real engine (offline,
the config's model and dtype, its pools' tensor-parallel degrees and torch threads) and
its KV transfer time, fitted to linear cost models (``planner.fitted``) and saved.

    pdserve profile configs/local-disagg.yaml --out profile.json

- prefill: one step of one prompt of each length, and of several prompts sharing the
  token budget (the same tokens, fewer attention pairs): time vs tokens and sum_sq;
- decode: steps of a running batch of each size at each context length;
- transfer: a tensor of each size sent between two processes over gloo (the raw
  transport the gloo backend uses; grpc configs are measured the same way).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

from pdserve.loadgen.workload_args import add_trace_arguments
from pdserve.loadgen.workloads import WORKLOADS
from pdserve.planner.fitted import FittedCost, fit_linear


@dataclass
class ProfileConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    threads: int = 1  # torch threads of an instance (tp 1)
    tp_degrees: tuple[int, ...] = (1,)
    prompt_lengths: tuple[int, ...] = (32, 128, 256, 512)
    split: int = 4  # the batched points: ``split`` prompts sharing one length's tokens
    decode_batches: tuple[int, ...] = (1, 4, 16)
    decode_contexts: tuple[int, ...] = (64, 512)
    decode_steps: int = 4
    transfer_mib: tuple[float, ...] = (1, 4, 16)
    kv_capacity_tokens: int = 2048 * 16
    repeats: int = 2


def _timed_step(engine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def _ids(n: int, vocab: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(n)]


def profile_engine(engine, cfg: ProfileConfig):
    """(prefill points (tokens, sum_sq, s), decode points (batch, context, s))."""
    from pdserve.engine import SamplingParams

    vocab = engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    salt = iter(range(1 << 30))
    prefill = []
    for length in cfg.prompt_lengths:
        for k in (1, cfg.split):
            if length // k < 1:
                continue
            times = []
            for _ in range(cfg.repeats + 1):  # the first is a warm-up
                for _ in range(k):
                    engine.add_request(f"p{next(salt)}", _ids(length // k, vocab, next(salt)), one)
                times.append(_timed_step(engine))
                while engine.has_unfinished_requests():
                    engine.step()
            prefill.append((k * (length // k), k * (length // k) ** 2, min(times[1:])))
    decode = []
    for ctx in cfg.decode_contexts:
        for batch in cfg.decode_batches:
            params = SamplingParams(max_tokens=cfg.decode_steps + 3, temperature=0, ignore_eos=True)
            for _ in range(batch):
                engine.add_request(f"d{next(salt)}", _ids(ctx, vocab, next(salt)), params)
            while engine.has_prompts_to_compute():
                engine.step()
            engine.step()  # the first full decode step (warm-up)
            for i in range(cfg.decode_steps):
                decode.append((batch, batch * (ctx + 2 + i), _timed_step(engine)))
            while engine.has_unfinished_requests():
                engine.step()
    return prefill, decode


def _receiver(port: int, sizes: list[int], rounds: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    ack = torch.zeros(1)
    for n in sizes:
        buf = torch.empty(n // 4)
        for _ in range(rounds):
            dist.recv(buf, 0)
            dist.send(ack, 0)
    dist.destroy_process_group()


def profile_transfer(mib: tuple[float, ...], rounds: int = 3) -> list[tuple[int, float]]:
    """(bytes, seconds) of gloo point-to-point sends between two local processes."""
    import multiprocessing as mp
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [int(m * (1 << 20)) // 4 * 4 for m in mib]
    proc = mp.get_context("spawn").Process(target=_receiver, args=(port, sizes, rounds + 1))
    proc.start()
    points = []
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        ack = torch.zeros(1)
        for n in sizes:
            buf, times = torch.ones(n // 4), []
            for _ in range(rounds + 1):
                t = time.perf_counter()
                dist.send(buf, 1)
                dist.recv(ack, 1)
                times.append(time.perf_counter() - t)
            points.append((n, statistics.median(times[1:])))
        dist.destroy_process_group()
    finally:
        proc.join(30)
    return points


def profile(cfg: ProfileConfig, log=lambda line: None) -> FittedCost:
    import torch

    from pdserve.engine import LLM, EngineConfig, LLMEngine

    prefill, decode, points = {}, {}, {"prefill": {}, "decode": {}}
    kv_bytes = 0
    for tp in cfg.tp_degrees:
        started = time.monotonic()
        torch.set_num_threads(cfg.threads)
        if tp == 1:
            engine, llm = LLMEngine(cfg.model, EngineConfig(dtype=cfg.dtype)), None
        else:
            llm = LLM(cfg.model, dtype=cfg.dtype, tensor_parallel=tp)
            engine = llm.engine
        mc = engine.model_config
        itemsize = engine.config.torch_dtype.itemsize
        kv_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * itemsize
        p, d = profile_engine(engine, cfg)
        if llm is not None:
            llm.close()
        prefill[tp] = fit_linear([[t, sq] for t, sq, _ in p], [s for *_, s in p])
        decode[tp] = fit_linear([[b, c] for b, c, _ in d], [s for *_, s in d])
        points["prefill"][tp], points["decode"][tp] = p, d
        log(
            f"profile: tp {tp}: prefill {_show(prefill[tp])}, decode {_show(decode[tp])} "
            f"({time.monotonic() - started:.0f} s)"
        )
    moved = profile_transfer(cfg.transfer_mib)
    transfer = fit_linear([[n] for n, _ in moved], [s for _, s in moved])
    gbps = 1 / max(transfer[1], 1e-15) / 1e9
    log(f"profile: transfer {transfer[0] * 1e3:.2f} ms + bytes at {gbps:.2f} GB/s")
    points["transfer"] = moved
    meta = {"model": cfg.model, "dtype": cfg.dtype, "threads": cfg.threads, "points": points}
    capacity = {tp: cfg.kv_capacity_tokens for tp in cfg.tp_degrees}
    return FittedCost(prefill, decode, transfer, kv_bytes, capacity, meta)


def _show(coef: list[float]) -> str:
    return f"{coef[0] * 1e3:.2f} ms + " + " + ".join(f"{c:.3g}" for c in coef[1:])


def from_cluster_config(path: str, overrides=()) -> ProfileConfig:
    from pdserve.cluster.config_loader import load_config

    config = load_config(path, overrides)
    pools = list(config.pools().values())
    degrees = tuple(sorted({p.tensor_parallel for p in pools}))
    threads = max(1, int(min(p.resources.num_cpus for p in pools)))
    blocks = max(p.kv_blocks * p.block_size for p in pools)
    return ProfileConfig(config.model, config.dtype, threads, degrees, kv_capacity_tokens=blocks)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config",
        nargs="+",
        help="YAML file: model, dtype, pools' tensor_parallel and CPUs (--served: several)",
    )
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    p.add_argument("--out", default="profile.json")
    served = p.add_argument_group("--served: fit the steps the configs' clusters serve")
    served.add_argument("--served", action="store_true", help="launch each config, replay load")
    served.add_argument("--workload", default="longprompt", choices=WORKLOADS)
    served.add_argument("--trace", help="trace file (--workload trace, azure, mooncake)")
    served.add_argument(
        "--rate", type=float, default=0.4, help="requests per second (not azure, mooncake)"
    )
    served.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="seconds of arrivals (azure, mooncake: trace seconds of the window)",
    )
    add_trace_arguments(served)
    served.add_argument("--seed", type=int, default=1)
    served.add_argument("--long-prompt-mean", type=int, default=384)
    served.add_argument("--long-output-mean", type=int, default=96)
    served.add_argument("--max-prompt-tokens", type=int)
    served.add_argument("--max-output-tokens", type=int)


def main(args: argparse.Namespace) -> int:
    from pdserve.cluster.config_loader import ConfigError

    log = lambda line: print(line, flush=True)  # noqa: E731
    started = time.monotonic()
    try:
        if args.served:
            from pdserve.loadgen.workload_args import workload_spec
            from pdserve.planner.served import profile_served

            cost = profile_served(
                args.config, args.set or [], workload_spec(args), args.rate, args.duration, log=log
            )
        else:
            if len(args.config) > 1:
                raise ValueError("give one config (several only with --served)")
            cost = profile(from_cluster_config(args.config[0], args.set or []), log=log)
    except (ConfigError, ValueError) as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 2
    cost.save(args.out)
    print(
        f"profile: wrote {args.out} in {time.monotonic() - started:.0f} s ({os.cpu_count()} CPUs)"
    )
    return 0
