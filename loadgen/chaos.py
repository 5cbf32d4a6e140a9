"""``pdserve chaos``: serve a ShareGPT load while the cluster's processes are killed
(engine instances, the supervisor, the router), and report what the clients saw.

    pdserve chaos configs/local-disagg.yaml --requests 40 --rate 1 --kill-every 20 \\
        --role any --signal KILL --max-tokens 32 --max-prompt-tokens 128 --out results/chaos

1. The prompts (ShareGPT first turns, cut to ``--max-prompt-tokens``) run offline
   through ``engine.LLM`` first, greedy, with the config's model, dtype and first
   pool's engine settings: the expected output of every request.
2. The config is launched on an embedded local Ray; the requests stream through the
   router (greedy, ``ignore_eos``, ``--max-tokens`` each) at ``--rate`` per second
   (Poisson or constant arrivals), while a killer (loadgen/chaos_killer.py) signals one
   process of a ``--role`` (comma-separated roles, or ``any``) every ``--kill-every``
   seconds and a sampler (loadgen/chaos_timeline.py) records the router's view and the
   control actors' pids every 0.5 s.
3. After the load it waits (at most ``--settle-s``) for every instance to serve
   again with all its blocks free and every control actor to answer, then runs each
   instance's ``check_integrity()``.
4. Report (loadgen/chaos_report.py): per request completed / failed / migrated and how
   a stream differed from the expected output; the kills with their recovery times,
   per role; the blocks each instance leaked; the gate (loadgen/chaos_verdict.py).
   Tables on stdout, the figures as JSON and the timeline as PNG under ``--out``.

Exit status: 0 when the run passed the gate (at least one signal sent, every
signalled process recovered within ``--recover-s``, nothing failed, mismatched or
leaked, every instance checked), 1 when not, 2 for a bad command line or config.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

from pdserve.loadgen.chaos_killer import (
    SIGNALS,
    Killer,
    KillEvent,
    check_choice,
    parse_roles,
    targets,
)
from pdserve.loadgen.chaos_load import StreamRecord, run_load
from pdserve.loadgen.chaos_report import format_report, summarize, write
from pdserve.loadgen.chaos_timeline import Sampler, one_line
from pdserve.loadgen.runner import QUIET
from pdserve.loadgen.workloads import WorkloadSpec, arrival_times, model_info, sample_requests

INTEGRITY_TIMEOUT_S = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML file (configs/local-disagg.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    p.add_argument("--requests", type=int, default=40, help="requests sent in all")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--arrivals", choices=["poisson", "constant"], default="poisson")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="prompts cut to this")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between signals")
    p.add_argument(
        "--role",
        default="any",
        help="whose process is signalled: prefill, decode, colocated, supervisor, router, "
        "several comma-separated, or any (every role, in seeded rounds)",
    )
    p.add_argument("--signal", choices=list(SIGNALS), default="KILL", help="STOP: a hang")
    p.add_argument("--seed", type=int, default=0, help="prompts, arrivals and victims")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-request deadline")
    p.add_argument("--settle-s", type=float, default=30.0, help="wait for recovery after the load")
    p.add_argument(
        "--recover-s", type=float, default=60.0, help="a signalled process must be back this soon"
    )
    p.add_argument("--out", default="results/chaos", help="folder of chaos.json and the plot")


def _check_args(args: argparse.Namespace, config) -> None:
    for flag, value in (
        ("--requests", args.requests),
        ("--rate", args.rate),
        ("--max-tokens", args.max_tokens),
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--timeout-s", args.timeout_s),
        ("--kill-every", args.kill_every),
        ("--recover-s", args.recover_s),
    ):
        if value <= 0:
            raise ValueError(f"{flag} {value}: must be > 0")
    if args.settle_s < 0:
        raise ValueError(f"--settle-s {args.settle_s}: must be >= 0")
    if config.ray.address is not None:
        raise ValueError(
            f"ray.address {config.ray.address!r}: chaos signals local pids, so it needs "
            "the embedded Ray (ray.address: null)"
        )


def prepare(config, args: argparse.Namespace) -> tuple[list[list[int]], list[float]]:
    """The prompts (token ids) and their arrival times (seconds from the start)."""
    tokenizer, max_len = model_info(config.model)
    if args.max_tokens >= max_len:
        raise ValueError(f"--max-tokens {args.max_tokens}: the context is {max_len} tokens")
    spec = WorkloadSpec(
        "sharegpt",
        seed=args.seed,
        max_prompt_tokens=min(args.max_prompt_tokens, max_len - args.max_tokens),
        dataset_limit=max(1000, 10 * args.requests),
    )
    prompts = [ids for ids, _ in sample_requests(spec, tokenizer, args.requests, max_len)]
    if args.arrivals == "constant":
        return prompts, [i / args.rate for i in range(args.requests)]
    return prompts, arrival_times(args.requests, args.rate, 1.0, args.seed)


def expected_outputs(config, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output, offline, with the first pool's engine settings."""
    from pdserve.engine import LLM, SamplingParams

    pool = next(iter(config.pools().values()))
    device = "cuda" if pool.resources.num_gpus > 0 else "cpu"
    llm = LLM(config.model, **pool.engine_config(config.dtype, config.attention_backend, device))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        return [out.token_ids for out in llm.generate(prompts, params)]
    finally:
        llm.close()


class Progress:
    """One status line on stderr: redrawn each second on a terminal, else every 5 s."""

    def __init__(self, total: int, sampler: Sampler, start: float):
        self.total, self.sampler, self.start = total, sampler, start
        self.tty, self.last, self.signals = sys.stderr.isatty(), 0.0, 0

    def __call__(self, records: list[StreamRecord], force: bool = False) -> None:
        now = time.monotonic() - self.start
        if not (self.tty or force or now - self.last >= 5.0):
            return
        self.last = now
        done = [r for r in records if r.end_s is not None]
        failed = sum(not r.completed for r in done)
        s = self.sampler.latest()
        live = "?" if s is None else f"{s.live}/{len(s.states)}"
        if s is not None and not self.sampler.answering():
            live += f" (router silent since +{s.t:.0f} s)"
        line = (
            f"chaos: sent {len(records)}/{self.total}, done {len(done)} (failed {failed}), "
            f"instances serving {live}, signals sent {self.signals}, "
            f"{now:.0f} s"
        )
        sys.stderr.write(f"\r{line}\033[K" if self.tty else f"{line}\n")
        sys.stderr.flush()

    def event(self, e: KillEvent) -> None:
        self.signals += e.skipped is None
        what = e.skipped or f"SIG{e.signal} {e.target} rank {e.rank} (pid {e.pid})"
        sys.stderr.write(("\n" if self.tty else "") + f"chaos: +{e.t:.1f} s {what}\n")
        sys.stderr.flush()


def settle(cluster, sampler: Sampler, timeout_s: float) -> bool:
    """Until every instance serves with all its blocks free, nothing is in flight and
    every control actor answered the sampler's last probe."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = ray.get(cluster.router.stats.remote(), timeout=2.0)
            per = stats["instances"]
            if (
                stats["in_flight"] == 0
                and all(
                    s["state"] == "serving" and s["free_blocks"] == s["total_blocks"] for s in per
                )
                and sampler.answering_control() == set(sampler.control)
            ):
                return True
        except Exception:  # the router did not answer: the timeline shows it too
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def integrity(names: list[str]) -> dict[str, dict]:
    """Each instance's ``check_integrity()`` (bounded): its free and total blocks and
    how many are leaked, or ``error`` when it could not be checked."""
    import ray

    from pdserve.cluster.ray_env import NAMESPACE

    out = {}
    for name in names:
        try:  # looked up by name: a restarted instance is a new actor
            actor = ray.get_actor(name, namespace=NAMESPACE)
            b = ray.get(actor.check_integrity.remote(), timeout=INTEGRITY_TIMEOUT_S)
            out[name] = {**b, "leaked": b["total_blocks"] - b["free_blocks"]}
        except Exception as e:  # dead, hung, or its block manager is inconsistent
            out[name] = {"error": one_line(e)}
    return out


def run(
    config, args: argparse.Namespace, prompts: list[list[int]], arrivals: list[float], log=print
) -> dict:
    """The whole run (``prepare``'s requests); the report's figures
    (loadgen/chaos_report.py)."""
    from pdserve.cluster.launcher import launch

    started = time.monotonic()
    expected = expected_outputs(config, prompts, args.max_tokens)
    log(
        f"chaos: expected outputs of {len(prompts)} prompts, offline, in "
        f"{time.monotonic() - started:.1f} s"
    )
    cluster = launch(config, [QUIET])
    log(f"chaos: cluster up at {cluster.address}")
    all_targets = targets(config)
    start = time.monotonic()
    control = tuple(t.name for t in all_targets if not t.instance)
    sampler = Sampler(cluster.router, start, control)
    sampler.start()
    progress = Progress(len(prompts), sampler, start)
    killer = Killer(
        all_targets,
        parse_roles(args.role),
        args.signal,
        args.kill_every,
        args.seed,
        sampler.live,
        start,
        progress.event,
    )
    try:
        killer.start()
        client = cluster.client()
        records = asyncio.run(
            run_load(client, prompts, arrivals, args.max_tokens, args.timeout_s, start, progress)
        )
        client.close()
        killer.stop()  # no signal once every stream has ended
        progress(records, force=True)
        if progress.tty:
            sys.stderr.write("\n")
        load_s = time.monotonic() - start
        settled = settle(cluster, sampler, args.settle_s)  # the sampler records the recovery on
        sampler.stop()  # its last sample is taken now: after settle saw the cluster settled
        checked = integrity([t.name for t in all_targets if t.instance])
    finally:
        if killer.is_alive():
            killer.stop()
        sampler.stop()
        # processes stopped and still there: ended here, so that Ray need not wait on them
        for pid in killer.stopped_pids():
            os.kill(pid, signal.SIGKILL)
        cluster.shutdown(drain=False)
    results = summarize(records, expected, killer.events, sampler.samples, checked, args.recover_s)
    load = {
        "requests": args.requests,
        "rate": args.rate,
        "arrivals": args.arrivals,
        "max_tokens": args.max_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "timeout_s": args.timeout_s,
        "seed": args.seed,
        "seconds": round(load_s, 2),
    }
    chaos = {
        "kill_every_s": args.kill_every,
        "role": args.role,
        "signal": args.signal,
        "recover_s": args.recover_s,
    }
    results.update(
        config=str(args.config),
        overrides=args.set or [],
        model=config.model,
        mode=config.mode,
        load=load,
        chaos=chaos,
        settled=settled,
    )
    return results


def main(args: argparse.Namespace) -> int:
    from pdserve.cluster.config_loader import ConfigError, load_config

    try:
        config = load_config(args.config, args.set or [])
        _check_args(args, config)
        check_choice(targets(config), parse_roles(args.role), args.signal)
        prompts, arrivals = prepare(config, args)
    except (ValueError, ConfigError) as e:
        print(f"pdserve chaos: {e}", file=sys.stderr)
        return 2
    log = lambda line: print(line, flush=True)  # noqa: E731
    results = run(config, args, prompts, arrivals, log)
    print(format_report(results), flush=True)
    path, plot = write(results, args.out)
    verdict = "passed" if results["summary"]["passed"] else "FAILED"
    print(f"chaos: {verdict}; figures in {path}, timeline in {plot}", flush=True)
    return 0 if results["summary"]["passed"] else 1
