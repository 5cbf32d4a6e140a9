"""An instance's own metrics (cluster/instance_metrics.py): the worker class the cluster
starts observes every engine step, with the stats after it, preemptions included.

In-process (no Ray cluster): the tiny model in a KV cache too small for its three
requests, so that the scheduler preempts. Ray's metrics agent, which would export
the recorded values, needs ``ray[default]``, whose aiohttp bound the project's
pinned aiohttp does not meet; the export is not tested here (docs/serving.md)."""

from __future__ import annotations

import time

from cluster.instance_metrics import RayInstanceMetrics, metered
from engine import SamplingParams
from engine.messages import Attempt
from engine.worker import EngineWorker
from tests.cluster.helpers import wait_until

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
CONFIG = {"num_kv_blocks": 8, "block_size": 16, "max_batch_tokens": 64}


def test_every_step_is_observed_with_the_stats_after_it(tiny_model):
    worker = metered(EngineWorker)("colocated-0", tiny_model("gqa2"), CONFIG, 1)
    try:
        assert type(worker).__name__ == "EngineWorker"
        (ray_metrics,) = [o.__self__ for o in worker.step_observers]
        assert isinstance(ray_metrics, RayInstanceMetrics)
        seen = []
        worker.step_observers.append(lambda shape, seconds, stats: seen.append((seconds, stats)))
        for i in range(3):
            worker.add(Attempt(f"r{i}", tuple(range(10 + i, 40 + i)), GREEDY, "test"))
        finished, deadline = set(), time.monotonic() + 120
        while len(finished) < 3:
            assert time.monotonic() < deadline
            updates = worker.poll("test", 1.0).updates
            finished |= {u.request_id for u in updates if u.finish_reason is not None}
        stats = worker.stats()
        assert stats["preemptions_total"] == worker.engine.scheduler.num_preemptions > 0
        # the observers run once the step's updates are out: the last one just after
        assert wait_until(lambda: len(seen) == stats["steps_total"], 10), (len(seen), stats)
        assert all(seconds > 0 for seconds, _ in seen)
        assert seen[-1][1]["preemptions_total"] == stats["preemptions_total"]
        assert ray_metrics._preempted == stats["preemptions_total"] and not ray_metrics._failed
    finally:
        worker.stop()
