"""What carrying one batch of updates from an instance to the router costs in CPU, each
side: a Ray actor call (the long poll's way: ``poll`` answering a ``Polled``), the same
with nothing in or out, one item of a streaming generator, and one frame of the update
feed (instance/feed.py, read by router/instances.py: the router's way).

    .venv/bin/python -m pdserve.bench.ray_calls [--items 3000] [--updates 8]

Two actors on an embedded Ray: an "instance" (threaded, as the cluster starts workers)
that answers a ``Polled`` of ``--updates`` one-token ``Update``s and the instance's
stats, and a "router" (async) that awaits them one after another (the feed: reads
``--items`` frames the instance's feed thread writes as fast as it can); CPU is each
process's user + system time (/proc) over ``--items`` answers, after as many to warm up.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from pdserve.bench.serving_overhead import cpu_seconds
from pdserve.instance.messages import CacheCursor, Polled, Update

WAYS = ("nothing", "poll", "stream", "feed")
STATS = {"running": 8, "queued": 0, "free_blocks": 500, "last_step": [0, 0, 8, 128, 0.01]}


def answer(updates: int) -> Polled:
    return Polled([Update(f"r{i}", [5], "x") for i in range(updates)], dict(STATS))


class Instance:
    def __init__(self, updates: int):
        from pdserve.instance.feed import FeedServer

        self.updates = updates
        self._left = 0  # feed frames still to write
        self._armed = threading.Condition()
        self._feed = FeedServer("bench", self._next_frame, {}, "127.0.0.1", "127.0.0.1")

    def open_feed(self, n: int):
        """A ticket to a feed that writes ``n`` answers (then heartbeats)."""
        with self._armed:
            self._left = n
        return self._feed.open("router", None)

    def _next_frame(self, consumer: str, timeout_s: float, cursor) -> Polled:
        with self._armed:
            if self._left > 0:
                self._left -= 1
                return answer(self.updates)
        time.sleep(timeout_s)
        return Polled([], dict(STATS))

    def pid(self) -> int:
        return os.getpid()

    def nothing(self) -> None:
        return None

    def poll(self, consumer: str, timeout_s: float, cache: CacheCursor) -> Polled:
        return answer(self.updates)

    def stream(self, n: int):
        for _ in range(n):
            yield answer(self.updates)


class Router:
    def __init__(self, instance):
        self.instance = instance

    def pid(self) -> int:
        return os.getpid()

    async def run(self, how: str, n: int) -> None:
        if how == "feed":
            await self._feed(n)
        elif how == "stream":
            async for ref in self.instance.stream.remote(n):
                await ref
        elif how == "poll":
            for _ in range(n):
                await self.instance.poll.remote("router", 0.5, CacheCursor())
        else:
            for _ in range(n):
                await self.instance.nothing.remote()

    async def _feed(self, n: int) -> None:
        import asyncio

        from pdserve.router.instances import FeedReader

        ticket = await self.instance.open_feed.remote(n)
        got, done = 0, asyncio.get_running_loop().create_future()

        def on_frame(polled: Polled) -> None:
            nonlocal got
            got += len(polled.updates) > 0
            if got == n and not done.done():
                done.set_result(None)

        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(
            lambda: FeedReader(ticket.token, on_frame), *ticket.endpoint()
        )
        await done
        transport.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--updates", type=int, default=8)
    args = parser.parse_args(argv)
    import ray

    from pdserve.cluster.config import RayConfig
    from pdserve.cluster.ray_env import RaySession

    session = RaySession(RayConfig(num_cpus=2))  # embedded, on loopback, as a cluster's
    session.start()
    try:
        instance = ray.remote(Instance).options(max_concurrency=8).remote(args.updates)
        router = ray.remote(Router).remote(instance)
        pids = ray.get(instance.pid.remote()), ray.get(router.pid.remote())
        print(f"load average {os.getloadavg()[0]:.1f}; {args.updates} updates per answer\n")
        print("| way | wall us/item | instance CPU us/item | router CPU us/item |")
        print("| --- | ---: | ---: | ---: |")
        for how in WAYS:
            ray.get(router.run.remote(how, args.items))  # warm up
            before, t = [cpu_seconds(p) for p in pids], time.perf_counter()
            ray.get(router.run.remote(how, args.items))
            wall = time.perf_counter() - t
            used = [
                (cpu_seconds(p) - b) / args.items * 1e6 for p, b in zip(pids, before, strict=True)
            ]
            print(f"| {how} | {wall / args.items * 1e6:.0f} | {used[0]:.0f} | {used[1]:.0f} |")
    finally:
        session.stop()


if __name__ == "__main__":
    main()
