"""The router's own overhead: the same requests through the router (gRPC client ->
router actor -> instance) and straight to the instances (their update feeds), in
one run, on a tiny model so that the engine's share is small.

    .venv/bin/python -m pdserve.bench.router [--requests 300] [--concurrency 1,16]
                                     [--prompt-tokens 16] [--max-tokens 8] [--model DIR]

Both paths use the same two co-located instances, the same round-robin placement
and each instance's update feed (instance/feed.py: requests up it, per-step output
batches down it); the direct path has a consumer of its own on the instances.
Latency is end to end at the caller (send -> last token); "added" is router minus
direct at the same percentile.
"""

from __future__ import annotations

import argparse
import itertools
import queue
import socket
import statistics
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.engine.sampling_params import SamplingParams
from pdserve.instance.feed import encode_command, frames
from pdserve.instance.messages import Attempt

CONSUMER = "bench-direct"


class DirectClient:
    """Requests straight to the instances, up their update feeds, and outputs down them,
    as the router sends and takes them; each caller gets every token batch of its
    request, as a streaming client does."""

    def __init__(self, handles: list):
        self.handles = handles
        self._next = itertools.cycle(range(len(handles)))
        self._lock = threading.Lock()
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._feeds = [self._connect(h) for h in handles]
        self._pollers = [
            threading.Thread(target=self._follow, args=(c,), daemon=True) for c in self._feeds
        ]
        for t in self._pollers:
            t.start()

    def complete(self, ids: list[int], max_tokens: int) -> list[int]:
        request_id = uuid.uuid4().hex
        stream: queue.SimpleQueue = queue.SimpleQueue()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        frame = encode_command("add", Attempt(request_id, tuple(ids), params, CONSUMER))
        with self._lock:  # one writer at a time on a feed: whole frames, in order
            self._streams[request_id] = stream
            self._feeds[next(self._next)].sendall(frame)
        tokens: list[int] = []
        while True:
            token_ids, reason = stream.get()
            tokens += token_ids
            if reason is not None:
                return tokens

    def close(self) -> None:
        for conn in self._feeds:
            conn.shutdown(socket.SHUT_RDWR)
        for t in self._pollers:
            t.join()
        for conn in self._feeds:
            conn.close()

    @staticmethod
    def _connect(handle) -> socket.socket:
        import ray

        ticket = ray.get(handle.open_feed.remote(CONSUMER, None))
        conn = socket.create_connection(ticket.endpoint(), timeout=30)
        conn.settimeout(None)
        conn.sendall(ticket.token.encode())
        return conn

    def _follow(self, conn: socket.socket) -> None:
        for polled in frames(conn):
            for u in polled.updates:
                with self._lock:
                    stream = self._streams.get(u.request_id)
                    if u.finish_reason is not None:
                        self._streams.pop(u.request_id, None)
                stream.put((u.token_ids, u.finish_reason))


def add_load_args(parser: argparse.ArgumentParser, concurrency: str) -> None:
    """The options of the benchmarks that send the same tiny requests through the router
    and to the instances directly (this one, serving_overhead.py, router_replicas.py)."""
    parser.add_argument("--concurrency", default=concurrency)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", help="a HF folder with a tokenizer (default: a tiny model)")


def prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--requests`` prompts of ``--prompt-tokens`` token ids, each different."""
    n = args.prompt_tokens
    return [[3 + (i * 7 + j) % 250 for j in range(n)] for i in range(args.requests)]


def measure(call, work: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    latencies: list[float] = []

    def one(ids):
        t = time.perf_counter()
        call(ids, max_tokens)
        latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, work))
    wall = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"rps": len(work) / wall, "p50": q[49] * 1000, "p99": q[98] * 1000}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_args(parser, "1,16")
    args = parser.parse_args(argv)

    import ray

    from pdserve.cluster import launch

    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        model = args.model or _tiny_model(Path(tmp))
        config = {
            "model": model,
            "router": {"port": 0, "http_port": 0, "policy": "round_robin", "max_queue": 4096},
            "colocated": {"instances": 2, "resources": {"num_cpus": 1}},
        }
        cluster = launch(config)
        try:
            handles = [ray.get_actor(n, namespace="pdserve") for n in cluster.workers]
            direct, client = DirectClient(handles), cluster.client()

            def routed(ids, max_tokens):
                stream = client.generate(
                    prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
                )
                return [t for chunk in stream for t in chunk.token_ids]

            work = prompts(args)
            for path in (direct.complete, routed):  # warm up both paths
                measure(path, work[:20], args.max_tokens, 4)
            same = direct.complete(work[0], args.max_tokens) == routed(work[0], args.max_tokens)
            assert same, "the two paths disagree on the same greedy request"
            rows = []
            for c in [int(x) for x in args.concurrency.split(",")]:
                d = measure(direct.complete, work, args.max_tokens, c)
                r = measure(routed, work, args.max_tokens, c)
                rows.append((c, d, r))
            direct.close()
            client.close()
        finally:
            cluster.shutdown(drain=False)
    _print(args, rows)


def _tiny_model(folder: Path) -> str:
    from tests.tiny_models import TINY_SHAPES, save_tiny_chat_llama

    save_tiny_chat_llama(folder, **TINY_SHAPES["gqa2"])
    return str(folder)


def _print(args, rows) -> None:
    print(
        f"\n{args.requests} requests of {args.prompt_tokens} prompt tokens -> "
        f"{args.max_tokens} tokens (greedy), 2 co-located instances of 1 CPU, round robin\n"
    )
    print(
        "| concurrency | path | requests/s | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| router/direct req/s |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c, d, r in rows:
        print(f"| {c} | direct (feed) | {d['rps']:.1f} | {d['p50']:.1f} | {d['p99']:.1f} | | | |")
        print(
            f"| {c} | router (gRPC) | {r['rps']:.1f} | {r['p50']:.1f} | {r['p99']:.1f} "
            f"| {r['p50'] - d['p50']:+.1f} | {r['p99'] - d['p99']:+.1f} "
            f"| {r['rps'] / d['rps']:.2f} |"
        )


if __name__ == "__main__":
    main()
