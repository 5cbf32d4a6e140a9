"""What serving costs over the engine (issue 23): the same requests, in one run,
(a) through the offline engine, (b) on the served instances called directly (up and
down their update feeds, as bench/router.py does), (c) through the router over gRPC
and (d) over its OpenAI HTTP API, per mode and concurrency; and, as the floor under
(c), the same gRPC calls answered by an echo with no router or engine behind it
(bench/grpc_floor.py).

    .venv/bin/python -m pdserve.bench.serving_overhead [--modes colocated,1p1d]
        [--concurrency 1,16,64] [--requests 300] [--prompt-tokens 16] [--max-tokens 8]
        [--model DIR] [--profile DIR [--profile-seconds 20]] [--quick]

Modes: ``colocated``, two co-located instances of 1 CPU (round robin); ``1p1d``, one
prefill and one decode instance of 1 CPU. The offline engine runs in this process,
before the cluster starts, on one torch thread with the pool's engine config: for two
co-located instances it serves ceil(c/2) requests at once (what each instance holds
under round robin at concurrency c) and its requests/s count twice (two such engines,
with nothing between them); for 1P1D it serves c at once (the decode instance's batch).
Prefix caching is off everywhere, so that repeated prompts cost the same on every path.

Per row: requests/s, p50/p99 latency (send -> last token at the caller), latency added
over the direct path (over offline when there is none: 1P1D has no direct path, its
handoff is the router's), requests/s against offline and direct, and the per-step time:
the median of the engine steps with decodes only, served (``step_log``: one turn of the
instance's loop, calls applied and the step) against offline (``engine.step()``); and
the CPU time per request of the engine instances' processes (offline: this process)
and of the router's process (/proc: user + system, every thread; on the floor row, the
echo's), and of the caller (this process: the load's threads and their client), which,
unlike latency, moves little with what else runs on the machine. A line per
concurrency splits the router's CPU into the gRPC floor and the router's own work.

``--profile DIR``: afterwards, py-spy samples the router's and instance 0's processes
for ``--profile-seconds`` while the gRPC path runs at concurrency 16 (co-located), and
writes collapsed stacks plus a top-functions summary per process (bench/serving_profile.py).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

from pdserve.bench.grpc_floor import GrpcFloor
from pdserve.bench.router import DirectClient, _tiny_model, add_load_args, measure, prompts
from pdserve.engine.sampling_params import SamplingParams
from pdserve.instance.logs import StepLog
from pdserve.loadgen.endpoint import DONE, completion_body, parse_event
from pdserve.loadgen.workloads import Request

POOL = {"resources": {"num_cpus": 1}, "prefix_caching": False}
MODES = {
    "colocated": {"mode": "colocated", "colocated": {"instances": 2, **POOL}},
    "1p1d": {"mode": "disaggregated", "prefill": dict(POOL), "decode": dict(POOL)},
}
PATHS = ("offline", "direct", "grpc floor", "grpc", "http")


def cluster_config(model: str, mode: str) -> dict:
    router = {"port": 0, "http_port": 0, "policy": "round_robin", "max_queue": 4096}
    return {"model": model, "router": router, **MODES[mode]}


def cpu_seconds(pid: int) -> float:
    """The user + system CPU seconds process ``pid`` has used (Linux: /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decode_step_ms(rows: list[list[float]]) -> float | None:
    """The median seconds (in ms) of ``step_log`` rows that computed decodes only."""
    decode = [r[4] for r in rows if r[0] == 0 and r[2] > 0]
    return statistics.median(decode) * 1000 if decode else None


def offline_engine(config: dict):
    """The engine an instance of ``config``'s serving pool runs, in this process; the
    text naming its CPU paths (as bench/engine.py names them)."""
    import torch

    from pdserve.cluster.config_loader import load_config
    from pdserve.engine import EngineConfig, LLMEngine
    from pdserve.engine.amx_gemm import amx_gemm

    cfg = load_config(config)
    pool = cfg.pools()["decode" if cfg.mode == "disaggregated" else "colocated"]
    torch.set_num_threads(max(1, math.floor(pool.resources.num_cpus)))
    engine = LLMEngine(cfg.model, EngineConfig(**pool.engine_config(cfg.dtype, None, "cpu")))
    engine.model.pack_panels()
    fast = engine.model.cpu_decode is not None
    path = "decode: " + ("C decode layers" if fast else "per-op torch layers")
    path += ", prefill GEMM: " + ("AMX" if amx_gemm() is not None else "torch")
    return engine, f"{path}, {torch.get_num_threads()} torch thread(s)"


def offline(engine, work: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """Closed loop on one engine: ``concurrency`` requests at once, the next added as one
    finishes; ``measure``'s figures plus the step rows."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    todo, started, latencies, steps = deque(work), {}, [], StepLog()
    serial = iter(range(len(work)))

    def add():
        request_id = f"offline-{concurrency}-{next(serial)}"
        started[request_id] = time.perf_counter()
        engine.add_request(request_id, todo.popleft(), params)

    start, cpu = time.perf_counter(), time.process_time()
    while todo and len(started) < concurrency:
        add()
    while started:
        t = time.perf_counter()
        outputs = engine.step()
        steps.record(engine.last_shape, time.perf_counter() - t)
        for o in outputs:
            if o.finish_reason is not None:
                latencies.append(time.perf_counter() - started.pop(o.request_id))
                if todo:
                    add()
    wall = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "rps": len(work) / wall,
        "p50": q[49] * 1000,
        "p99": q[98] * 1000,
        "step": decode_step_ms(steps.take()),
        "engine_cpu": (time.process_time() - cpu) / len(work) * 1000,
    }


def http_path(address: str):
    """A caller of the router's ``POST /v1/completions`` (streaming), and its client."""
    import httpx

    client = httpx.Client(base_url=f"http://{address}", timeout=120)

    def call(ids: list[int], max_tokens: int) -> None:
        body = completion_body(Request(0.0, ids, max_tokens), None)
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if parse_event(line) is DONE:
                    return
        raise RuntimeError("the stream ended without [DONE]")

    return call, client


def run_mode(mode: str, model: str, work, args, levels: list[int]) -> tuple[str, list]:
    """Every path at every concurrency for one mode: its CPU path and its rows
    ``(concurrency, {path: figures})``."""
    import ray

    from pdserve.cluster import launch

    config = cluster_config(model, mode)
    n = MODES[mode]["colocated"]["instances"] if mode == "colocated" else 1
    engine, cpu_path = offline_engine(config)
    offline(engine, work[:20], args.max_tokens, 4)  # warm up
    rows = [(c, {"offline": offline(engine, work, args.max_tokens, -(-c // n))}) for c in levels]
    for c, figures in rows:
        figures["offline"]["rps"] *= min(c, n)
    del engine
    cluster = launch(config, ["logging.level=WARNING"])
    try:
        handles = [ray.get_actor(name, namespace="pdserve") for name in cluster.workers]
        from pdserve.router.client import RouterClient

        client, floor = cluster.client(), GrpcFloor()
        floor_client = RouterClient(floor.address)
        http, http_client = http_path(cluster.http_address)

        def caller(client):
            def call(ids, max_tokens):
                stream = client.generate(
                    prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
                )
                return [t for chunk in stream for t in chunk.token_ids]

            return call

        grpc = caller(client)
        paths = {"grpc floor": caller(floor_client), "grpc": grpc, "http": http}
        direct = DirectClient(handles) if mode == "colocated" else None
        if direct is not None:
            paths = {"direct": direct.complete, **paths}
            assert direct.complete(work[0], args.max_tokens) == grpc(work[0], args.max_tokens)
        for call in paths.values():  # warm up every path
            measure(call, work[:20], args.max_tokens, 4)
        pids = [ray.get(h.ready.remote())["pid"] for h in handles]
        router_pid = ray.get(cluster.router.pid.remote())
        for c, figures in rows:
            for name, call in paths.items():
                for h in handles:
                    ray.get(h.step_log.remote())
                engine_cpu = sum(cpu_seconds(p) for p in pids)
                server_pid = floor.pid if name == "grpc floor" else router_pid
                router_cpu, client_cpu = cpu_seconds(server_pid), time.process_time()
                f = figures[name] = measure(call, work, args.max_tokens, c)
                f["client_cpu"] = (time.process_time() - client_cpu) / len(work) * 1000
                f["engine_cpu"] = (
                    (sum(cpu_seconds(p) for p in pids) - engine_cpu) / len(work) * 1000
                )
                f["router_cpu"] = (cpu_seconds(server_pid) - router_cpu) / len(work) * 1000
                steps = [row for h in handles for row in ray.get(h.step_log.remote())]
                f["step"] = decode_step_ms(steps)
        if args.profile and direct is not None:
            _profile(cluster, handles, grpc, work, args)
        if direct is not None:
            direct.close()
        client.close()
        floor_client.close()
        floor.close()
        http_client.close()
    finally:
        cluster.shutdown(drain=False)
    return cpu_path, rows


def _profile(cluster, handles, call, work, args) -> None:
    import ray

    from pdserve.bench import serving_profile

    folder = Path(args.profile)
    pids = {
        "router": ray.get(cluster.router.pid.remote()),
        "instance": ray.get(handles[0].ready.remote())["pid"],
    }
    procs = serving_profile.record(pids, args.profile_seconds, folder)
    while any(p.poll() is None for p in procs):
        measure(call, work[:64], args.max_tokens, 16)
    for path in serving_profile.finish(procs, folder):
        print(f"profile: {path}")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else ""


def _print(args, mode: str, cpu_path: str, rows) -> None:
    print(
        f"\n### {mode}: {args.requests} requests of {args.prompt_tokens} prompt tokens -> "
        f"{args.max_tokens} tokens (greedy); {cpu_path}\n"
    )
    print(
        "| concurrency | path | requests/s | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| req/s vs offline | req/s vs direct | decode step ms | step vs offline "
        "| instances CPU ms/req | router CPU ms/req | caller CPU ms/req |"
    )
    print("| ---: | --- " + "| ---: " * 12 + "|")
    for c, figures in rows:
        off, direct = figures["offline"], figures.get("direct")
        base = direct or off
        for name in (p for p in PATHS if p in figures):
            f = figures[name]
            routed = name in ("grpc", "http")
            cells = [f"{f['rps']:.1f}", f"{f['p50']:.1f}", f"{f['p99']:.1f}"]
            cells += (
                [f"{f['p50'] - base['p50']:+.1f}", f"{f['p99'] - base['p99']:+.1f}"]
                if routed
                else ["", ""]
            )
            cells.append(
                _ratio(f["rps"], off["rps"]) if name not in ("offline", "grpc floor") else ""
            )
            cells.append(_ratio(f["rps"], direct["rps"]) if routed and direct else "")
            cells.append("" if f["step"] is None else f"{f['step']:.2f}")
            cells.append(_ratio(f["step"], off["step"]) if name != "offline" else "")
            cells.append(f"{f['engine_cpu']:.2f}")
            cells.append(f"{f['router_cpu']:.2f}" if "router_cpu" in f else "")
            cells.append(f"{f['client_cpu']:.2f}" if "client_cpu" in f else "")
            print(f"| {c} | {name} | " + " | ".join(cells) + " |")
    print()
    for c, figures in rows:
        floor, grpc = figures.get("grpc floor"), figures.get("grpc")
        if floor and grpc:
            own = grpc["router_cpu"] - floor["router_cpu"]
            print(
                f"concurrency {c}: router CPU {grpc['router_cpu']:.2f} ms/req = gRPC floor "
                f"{floor['router_cpu']:.2f} + the router's own {own:.2f}; caller "
                f"{grpc['client_cpu']:.2f} ms/req (on the floor "
                f"{floor['client_cpu']:.2f})"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="colocated,1p1d")
    add_load_args(parser, "1,16,64")
    parser.add_argument("--profile", metavar="DIR", help="py-spy the router and an instance")
    parser.add_argument("--profile-seconds", type=int, default=20)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: co-located, concurrency 1,4, 24 requests"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.modes, args.concurrency, args.requests = "colocated", "1,4", 24
        args.profile_seconds = min(args.profile_seconds, 3)
    levels = [int(x) for x in args.concurrency.split(",")]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"cpus {os.cpu_count()}, load average {load} at the start")
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        model = args.model or _tiny_model(Path(tmp))
        work = prompts(args)
        for mode in args.modes.split(","):
            cpu_path, rows = run_mode(mode, model, work, args, levels)
            _print(args, mode, cpu_path, rows)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nload average {load} at the end")


if __name__ == "__main__":
    main()
