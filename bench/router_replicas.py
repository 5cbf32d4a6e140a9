"""Router replicas against one router (``router.replicas``, router/replicas.py): the same
requests over gRPC through a cluster whose router is 1 replica, then N, each against
the same instances called directly (their update feeds, bench/router.py's client), in
one run, on a tiny model so that the router's share is large.

    .venv/bin/python -m pdserve.bench.router_replicas [--replicas 2] [--concurrency 16,64]
        [--requests 300] [--prompt-tokens 16] [--max-tokens 8] [--model DIR]

Two co-located instances of 1 CPU, round robin. Every load thread has a client of its
own (a connection of its own), so that the kernel spreads the connections over the
replicas' listeners (SO_REUSEPORT); the 1-replica cluster is driven the same way. Per
row: requests/s, p50/p99 latency at the caller, requests/s against direct, the CPU
milliseconds per request of every router process together (/proc: user + system,
every thread), and how many requests each replica placed. What more replicas can buy
is bounded by free cores: with the instances, the replicas and the load generator on
the same few cores, a router process that is not alone on a core gains nothing from a
second one; the machine's CPU count is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
from pathlib import Path

from pdserve.bench.router import DirectClient, _tiny_model, add_load_args, measure, prompts
from pdserve.bench.serving_overhead import cpu_seconds


class PerThreadClients:
    """``call(ids, max_tokens)`` over gRPC through a ``RouterClient`` of the calling
    thread's own (each its own connection)."""

    def __init__(self, cluster):
        self.cluster, self._local, self.clients = cluster, threading.local(), []
        self._lock = threading.Lock()

    def call(self, ids: list[int], max_tokens: int) -> list[int]:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self.cluster.client()
            with self._lock:
                self.clients.append(client)
        stream = client.generate(
            prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
        return [t for chunk in stream for t in chunk.token_ids]

    def close(self) -> None:
        for client in self.clients:
            client.close()


def run(model: str, replicas: int, work, args, levels: list[int]) -> list[tuple]:
    """``(concurrency, direct figures, routed figures)`` per level, on a cluster whose
    router has ``replicas`` replicas."""
    import ray

    from pdserve.cluster import launch

    config = {
        "model": model,
        "router": {
            "port": 0,
            "http_port": 0,
            "policy": "round_robin",
            "max_queue": 4096,
            "replicas": replicas,
        },
        "colocated": {"instances": 2, "resources": {"num_cpus": 1}, "prefix_caching": False},
    }
    cluster = launch(config, ["logging.level=WARNING"])
    try:
        handles = [ray.get_actor(n, namespace="pdserve") for n in cluster.workers]
        direct, routed = DirectClient(handles), PerThreadClients(cluster)
        for call in (direct.complete, routed.call):  # warm up both paths
            measure(call, work[:32], args.max_tokens, 8)
        same = direct.complete(work[0], args.max_tokens) == routed.call(work[0], args.max_tokens)
        assert same, "the two paths disagree on the same greedy request"
        pids = [cluster.router_pid(replica=k) for k in range(replicas)]
        rows = []
        for c in levels:
            print(f"  {replicas} replica(s), concurrency {c} ...", flush=True)
            d = measure(direct.complete, work, args.max_tokens, c)
            before_cpu = sum(cpu_seconds(p) for p in pids)
            before = placed(cluster)
            r = measure(routed.call, work, args.max_tokens, c)
            r["router_cpu"] = (sum(cpu_seconds(p) for p in pids) - before_cpu) / len(work) * 1e3
            r["placed"] = [a - b for a, b in zip(placed(cluster), before, strict=True)]
            rows.append((c, d, r))
        direct.close()
        routed.close()
    finally:
        cluster.shutdown(drain=False)
    return rows


def placed(cluster) -> list[int]:
    import ray

    counts = ray.get([r.own_counts.remote() for r in cluster.routers], timeout=30)
    return [sum(total for _, total in c["instances"].values()) for c in counts]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    add_load_args(parser, "16,64")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    work = prompts(args)
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        model = args.model or _tiny_model(Path(tmp))
        results = {n: run(model, n, work, args, levels) for n in (1, args.replicas)}
    print(
        f"\n{args.requests} requests of {args.prompt_tokens} prompt tokens -> "
        f"{args.max_tokens} tokens (greedy), 2 co-located instances of 1 CPU, round robin, "
        f"a gRPC client per load thread; {os.cpu_count()} CPUs\n"
    )
    print(
        "| concurrency | router replicas | direct req/s | router req/s | router/direct "
        "| p50 ms | p99 ms | router CPU ms/req | placed per replica |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for i, c in enumerate(levels):
        for n, rows in results.items():
            _, d, r = rows[i]
            print(
                f"| {c} | {n} | {d['rps']:.1f} | {r['rps']:.1f} | {r['rps'] / d['rps']:.2f} "
                f"| {r['p50']:.1f} | {r['p99']:.1f} | {r['router_cpu']:.2f} "
                f"| {' / '.join(map(str, r['placed']))} |"
            )
    for i, c in enumerate(levels):
        one, more = results[1][i][2], results[args.replicas][i][2]
        print(
            f"concurrency {c}: {args.replicas} replicas / 1, requests/s "
            f"{more['rps'] / one['rps']:.2f}"
        )


if __name__ == "__main__":
    main()
