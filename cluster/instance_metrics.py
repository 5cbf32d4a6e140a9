"""Each engine instance's own metrics, through Ray's metrics agent (docs/serving.md,
"Metrics and logs"): the engine's view, per step, beside the router's request view.

``metered(worker_class)`` is the worker class the cluster starts as rank 0 of an
instance: the same class, whose instances observe every engine step
(``EngineWorker.step_observers``) into ``ray.util.metrics``. Ray's metrics agent on
each node exports them on that node's metrics export port (``ray start
--metrics-export-port``) with Ray's ``ray_`` prefix, tags ``instance`` and ``role``:

    ray_pdserve_engine_step_seconds     histogram  one turn of the step loop
    ray_pdserve_engine_step_tokens      histogram  tokens the step computed
    ray_pdserve_engine_requests_running gauge      requests in the running batch
    ray_pdserve_engine_requests_waiting gauge      requests waiting in the instance
    ray_pdserve_engine_free_kv_blocks   gauge      free KV cache blocks
    ray_pdserve_engine_preemptions      counter    running requests preempted

Without the agent (Ray installed without ``ray[default]``) recording is a no-op.
"""

from __future__ import annotations

import logging

from engine.scheduler import StepShape

log = logging.getLogger(__name__)

TAGS = ("instance", "role")
STEP_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
STEP_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


class RayInstanceMetrics:
    """The metrics of one instance; ``observe`` is its step observer (called on the
    instance's step loop only)."""

    def __init__(self, name: str, role: str):
        from ray.util.metrics import Counter, Gauge, Histogram

        self.tags = {"instance": name, "role": role}
        self.step_seconds = Histogram("pdserve_engine_step_seconds", "One turn of the step loop.",
                                      boundaries=STEP_SECONDS, tag_keys=TAGS)  # fmt: skip
        self.step_tokens = Histogram("pdserve_engine_step_tokens", "Tokens one step computed.",
                                     boundaries=STEP_TOKENS, tag_keys=TAGS)  # fmt: skip
        self.running = Gauge("pdserve_engine_requests_running", "Running batch.", tag_keys=TAGS)
        self.waiting = Gauge("pdserve_engine_requests_waiting", "Waiting requests.", tag_keys=TAGS)
        self.free_blocks = Gauge("pdserve_engine_free_kv_blocks", "Free KV blocks.", tag_keys=TAGS)
        self.preemptions = Counter("pdserve_engine_preemptions", "Preempted requests.",
                                   tag_keys=TAGS)  # fmt: skip
        self._preempted = 0  # preemptions_total at the previous step
        self._failed = False  # one log line for a broken recorder, not one per step

    def observe(self, shape: StepShape, seconds: float, stats: dict) -> None:
        """Never raises: the step loop must not stop for its metrics."""
        try:
            self.step_seconds.observe(seconds, tags=self.tags)
            self.step_tokens.observe(shape.prefill_tokens + shape.decodes, tags=self.tags)
            self.running.set(stats["running"], tags=self.tags)
            self.waiting.set(stats["queued"], tags=self.tags)
            self.free_blocks.set(stats["free_blocks"], tags=self.tags)
            new = stats["preemptions_total"] - self._preempted
            if new > 0:
                self.preemptions.inc(new, tags=self.tags)
            self._preempted = stats["preemptions_total"]
        except Exception:
            if not self._failed:
                log.exception("%s: recording its Ray metrics failed", self.tags["instance"])
            self._failed = True


def metered(worker_class: type) -> type:
    """``worker_class`` whose instances record ``RayInstanceMetrics`` (same name, so
    Ray's state API lists the actor under the worker's class)."""

    class Metered(worker_class):
        def __init__(self, name: str, *args, **kwargs):
            super().__init__(name, *args, **kwargs)
            self.step_observers.append(RayInstanceMetrics(name, self.role).observe)

    Metered.__name__ = Metered.__qualname__ = worker_class.__name__
    return Metered
