"""A served engine step against the same step offline (issue 23): what the instance's
loop (inbox, outboxes, the update feed's frames, stats) adds to each step.

    .venv/bin/python -m pdserve.bench.served_step [--model smollm2-135m] [--batches 1,32]
        [--prefill-tokens 512] [--window-s 2] [--rounds 7]

One co-located instance of 1 CPU (prefix caching off), and the same engine in this
process on one torch thread. For each batch size b: b requests of 16 prompt tokens that
decode until the model's context runs out; once all b decode, the period of a decode
step is measured over ``--window-s`` seconds (a window the batch does not outlast ends
at its first finish offline, and is refused served), served and offline in turn,
``--rounds`` times (the other side idle meanwhile: the instance's loop waits without
spinning, the offline engine is not stepped). Served, the period is wall time over the
instance's own step count (``stats()['steps_total']``), with the instance's updates
taken by the router's own consumer (``router.instances.Instance``, on an event loop in a
thread of this process): every cost of serving a step is in it. Then one prompt of
``--prefill-tokens`` tokens alone, ``--rounds`` times: its prefill step served
(``step_log``) against ``engine.step()`` offline. Printed: per figure the best of the
rounds (as ``timeit`` reports: what the step costs when nothing else on the machine
interferes, the figure this shared machine moves least) and their median, served /
offline of each, and the CPU path that ran.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

from pdserve.bench.serving_overhead import offline_engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.instance.messages import Attempt

CONSUMER = "bench-steps"  # this bench's outbox on the instance (the router has its own)
PROMPT = 16


def prompts(n: int, tokens: int, vocab: int) -> list[list[int]]:
    """Distinct prompts (no shared block: prefix caching is off anyway)."""
    return [[(7 + 31 * i + 11 * k) % (vocab - 10) + 5 for k in range(tokens)] for i in range(n)]


def offline_period(engine, batch: int, window_s: float, max_tokens: int) -> float:
    """Seconds per decode step of ``batch`` requests, over ``window_s``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [uuid.uuid4().hex for _ in range(batch)]
    for rid, p in zip(ids, prompts(batch, PROMPT, engine.model_config.vocab_size), strict=True):
        engine.add_request(rid, p, params)
    while engine.has_prompts_to_compute():
        engine.step()  # the prompts
    engine.step()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < window_s:
        outputs = engine.step()
        steps += 1
        if any(o.finish_reason is not None for o in outputs):
            break  # the model's context is spent: steps from here would not be whole
    period = (time.perf_counter() - start) / steps
    for rid in ids:
        engine.abort_request(rid)
    return period


def offline_prefill(engine, tokens: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("prefill", prompts(1, tokens, engine.model_config.vocab_size)[0], params)
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    engine.abort_request("prefill")
    return seconds


class Served:
    """The instance's handle, its updates consumed by the router's own consumer
    (``router.instances.Instance``, on an event loop in a thread of this process)."""

    def __init__(self, handle, vocab: int):
        import asyncio

        from pdserve.router import instances

        self.handle, self.vocab = handle, vocab
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        # the router's consumer, under this bench's name
        self._instance = instances.Instance("bench", "colocated", handle, 0, consumer=CONSUMER)

        async def start():
            await self._instance.wait_ready()
            self._instance.start_feed(
                lambda inst, updates: None, self._dead, lambda inst, live: None
            )

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=60)

    @staticmethod
    def _dead(inst, why: str) -> None:
        raise RuntimeError(why)

    def stats(self) -> dict:
        import ray

        return ray.get(self.handle.stats.remote())

    def add(self, batch: int, tokens: int, max_tokens: int) -> list[str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [uuid.uuid4().hex for _ in range(batch)]
        for rid, p in zip(ids, prompts(batch, tokens, self.vocab), strict=True):
            self.handle.add.remote(Attempt(rid, tuple(p), params, CONSUMER))
        return ids

    def period(self, batch: int, window_s: float, max_tokens: int) -> float:
        ids = self.add(batch, PROMPT, max_tokens)
        deadline = time.monotonic() + 120
        while (s := self.stats())["running"] < batch or s["queued"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the instance never ran {batch} requests at once: {s}")
            time.sleep(0.05)
        time.sleep(0.5)  # every prompt done: decode-only steps from here
        first, start = self.stats()["steps_total"], time.perf_counter()
        time.sleep(window_s)
        s, end = self.stats(), time.perf_counter()
        self.handle.abort.remote(ids)
        if s["running"] < batch:  # the instance idled for part of the window
            raise RuntimeError(
                f"batch {batch}: its requests ended within the window (the model's context "
                "runs out first); use a shorter --window-s or a model with a longer context"
            )
        return (end - start) / max(1, s["steps_total"] - first)

    def prefill(self, tokens: int) -> float:
        import ray

        ray.get(self.handle.step_log.remote())
        self.add(1, tokens, 1)
        deadline = time.monotonic() + 120
        while True:
            rows = ray.get(self.handle.step_log.remote())
            done = [r for r in rows if r[0] == tokens]
            if done:
                return done[0][4]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no prefill step of {tokens} tokens came")
            time.sleep(0.5)  # seldom: each look is a Ray call the instance answers

    def close(self) -> None:
        import asyncio

        stop = asyncio.run_coroutine_threadsafe(self._instance.stop_feed(), self._loop)
        stop.result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def main(argv: list[str] | None = None) -> None:
    import ray

    from pdserve.cluster import launch

    p = argparse.ArgumentParser(
        prog="pdserve.bench.served_step", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    pool = {
        "instances": 1,
        "resources": {"num_cpus": 1},
        "prefix_caching": False,
        "max_batch_size": max(batches),
        "max_batch_tokens": max(512, args.prefill_tokens),
    }
    config = {"model": args.model, "router": {"port": 0, "http_port": 0}, "colocated": pool}
    engine, cpu_path = offline_engine(config)
    max_tokens = engine.max_context - PROMPT  # decode until the context runs out
    offline_prefill(engine, args.prefill_tokens)  # warm up
    cluster = launch(config, ["logging.level=WARNING"])
    try:
        [name] = cluster.workers
        served = Served(ray.get_actor(name, namespace="pdserve"), engine.model_config.vocab_size)
        served.prefill(args.prefill_tokens)  # warm up
        rows = []
        for b in batches:
            off, on = [], []
            for _ in range(args.rounds):
                off.append(offline_period(engine, b, args.window_s, max_tokens))
                on.append(served.period(b, args.window_s, max_tokens))
            rows.append((f"decode step, batch {b}", off, on))
        off = [offline_prefill(engine, args.prefill_tokens) for _ in range(args.rounds)]
        on = [served.prefill(args.prefill_tokens) for _ in range(args.rounds)]
        rows.append((f"prefill, {args.prefill_tokens} tokens", off, on))
        served.close()
    finally:
        cluster.shutdown(drain=False)
    print(
        f"\n{args.model}: one co-located instance of 1 CPU against the same engine in "
        f"this process; {cpu_path}\n"
    )
    print(
        "| step | offline ms, best / median | served ms, best / median "
        "| served / offline, best | median |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for what, off, on in rows:
        o, s = (min(off), statistics.median(off)), (min(on), statistics.median(on))
        print(
            f"| {what} | {o[0] * 1000:.2f} / {o[1] * 1000:.2f} | {s[0] * 1000:.2f} / "
            f"{s[1] * 1000:.2f} | {s[0] / o[0]:.3f} | {s[1] / o[1]:.3f} |"
        )


if __name__ == "__main__":
    main()
