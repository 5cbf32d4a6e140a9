"""One engine instance behind a Ray actor: requests in, token batches out.

The cluster wraps ``EngineWorker`` with ``ray.remote`` (a threaded actor), so its
methods run on a small thread pool while a background thread runs the engine's
step loop. Callers never touch the engine: ``add``/``abort`` go into an inbox the
loop drains before each step, and outputs go into one outbox per consumer (the
router, a benchmark) that ``poll`` hands over in one batch: everything produced
since the last poll, so a busy instance costs its consumer one call per step at
most, never one per token.

In co-located mode every step is the engine's mixed step: prompt chunks
piggybacked on the running decodes (engine/scheduler.py).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections import OrderedDict, defaultdict, deque

import torch

from engine import EngineConfig, LLMEngine, SamplingParams

# (request_id, new token ids, new text, finish_reason or None, error message or None)
Output = tuple[str, list[int], str, str | None, str | None]


class EngineWorker:
    def __init__(self, name: str, model: str, engine_config: dict, num_threads: int):
        torch.set_num_threads(max(1, num_threads))
        self.name = name
        self.engine = LLMEngine(model, EngineConfig(**engine_config))
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the loop waits here for requests
        self._produced = threading.Condition(self._lock)  # poll waits here for outputs
        self._inbox: deque[tuple] = deque()
        self._outboxes: dict[str, list[Output]] = defaultdict(list)
        self._consumer: dict[str, str] = {}  # request id -> whose outbox
        # aborts that arrived before their add (a threaded actor may reorder calls)
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._totals = {"requests_total": 0, "tokens_total": 0, "steps_total": 0}
        self._snapshot = self._stats()
        self._stopping = False
        self._loop = threading.Thread(target=self._run, name=f"{name}-steps", daemon=True)
        self._loop.start()

    # ---- calls (from the router or a benchmark, through the actor handle) ----

    def ready(self) -> dict:
        """Facts the router needs; answering at all means the model is loaded."""
        e = self.engine
        return {
            "name": self.name,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "max_context": e.max_context,
            "vocab_size": e.model_config.vocab_size,
            "num_blocks": e.blocks.num_blocks,
            "block_size": e.blocks.block_size,
            "max_batch_size": e.config.max_batch_size,
        }

    def add(self, request_id: str, prompt_ids: list[int], params: dict, consumer: str) -> None:
        """Queue a request; its outputs go to ``consumer``'s outbox."""
        with self._lock:
            self._inbox.append(("add", request_id, prompt_ids, params, consumer))
            self._work.notify()

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests (queued, running or not yet arrived) and free their blocks."""
        with self._lock:
            self._inbox.append(("abort", list(request_ids)))
            self._work.notify()

    def poll(self, consumer: str, timeout_s: float) -> tuple[list[Output], dict]:
        """Everything produced for ``consumer`` since its last poll (waits up to timeout_s)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._outboxes.get(consumer) and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._produced.wait(left)
            items = self._outboxes.pop(consumer, [])
            return items, dict(self._snapshot)

    def stats(self) -> dict:
        with self._lock:
            return dict(self._snapshot)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            self._produced.notify_all()
        self._loop.join(timeout=10)

    # ---- the step loop (its own thread; the only code that touches the engine) ----

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()):
                    self._work.wait()
                if self._stopping:
                    return
                ops = list(self._inbox)
                self._inbox.clear()
            produced = [out for op in ops for out in self._apply(op)]
            if self.engine.has_unfinished_requests():
                produced += self._step()
            with self._lock:
                for out in produced:
                    consumer = self._consumer.get(out[0])
                    if consumer is not None:
                        self._outboxes[consumer].append(out)
                    if out[3] is not None:
                        self._consumer.pop(out[0], None)
                self._snapshot = self._stats()
                self._produced.notify_all()

    def _apply(self, op: tuple) -> list[Output]:
        if op[0] == "abort":
            for request_id in op[1]:
                if request_id in self.engine.requests:
                    self.engine.abort_request(request_id)
                    self._consumer.pop(request_id, None)
                else:
                    self._early_aborts[request_id] = None
                    while len(self._early_aborts) > 10_000:
                        self._early_aborts.popitem(last=False)
            return []
        _, request_id, prompt_ids, params, consumer = op
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            return []
        self._consumer[request_id] = consumer
        try:
            self.engine.add_request(request_id, prompt_ids, SamplingParams(**params))
        except ValueError as e:
            return [(request_id, [], "", "error", str(e))]
        self._totals["requests_total"] += 1
        return []

    def _step(self) -> list[Output]:
        try:
            outputs = self.engine.step()
        except Exception:  # a bug in the engine: fail its requests, keep the instance up
            message = f"{self.name}: engine step failed:\n{traceback.format_exc()}"
            failed = list(self.engine.requests)
            for request_id in failed:
                self.engine.abort_request(request_id)
            return [(request_id, [], "", "error", message) for request_id in failed]
        self._totals["steps_total"] += 1
        out: list[Output] = []
        for o in outputs:
            self._totals["tokens_total"] += len(o.new_token_ids)
            out.append((o.request_id, o.new_token_ids, o.new_text, o.finish_reason, None))
        return out

    def _stats(self) -> dict:
        s = self.engine.scheduler
        return {
            "name": self.name,
            "queued": len(s.waiting) + len(self._inbox),
            "running": len(s.running),
            "free_blocks": self.engine.blocks.num_free_blocks,
            "total_blocks": self.engine.blocks.num_blocks,
            **self._totals,
        }
