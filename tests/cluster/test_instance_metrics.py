"""An instance's own metrics (cluster/instance_metrics.py): the worker class the cluster
starts observes every engine step into its registry and serves it, behind the router's
API keys, on a port of its own.

In-process (no Ray cluster): the tiny model in a KV cache too small for its three
requests, so that the scheduler preempts; scraped over HTTP on loopback and read with
prometheus_client's parser. The cluster's side (the router's ``/metrics/targets``, a
scrape of each instance) is in tests/cluster/test_router_metrics.py."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.instance_metrics import metered
from pdserve.engine import SamplingParams
from pdserve.instance.messages import Attempt
from pdserve.instance.worker import EngineWorker
from tests.cluster.helpers import wait_until

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
CONFIG = {"num_kv_blocks": 8, "block_size": 16, "max_batch_tokens": 64}
KEY = "scrape-key-0123456789"
METRICS = {"bind": "127.0.0.1", "advertise": None, "port": 0,
           "key_digests": [hashlib.sha256(KEY.encode()).hexdigest()]}  # fmt: skip


def samples(text: str) -> dict[tuple, float]:
    """(name, sorted labels) -> value of every sample of one exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_step_is_observed_with_the_stats_after_it(tiny_model):
    worker = metered(EngineWorker)("colocated-0", tiny_model("gqa2"), CONFIG, 1, metrics=METRICS)
    try:
        assert type(worker).__name__ == "EngineWorker"
        address = worker.ready()["metrics"]
        assert address.startswith("127.0.0.1:")
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

        url, auth = f"http://{address}/metrics", {"Authorization": f"Bearer {KEY}"}
        got = samples(httpx.get(url, headers=auth, timeout=10).text)
        me = (("instance", "colocated-0"), ("role", "colocated"))
        assert got["pdserve:engine_step_seconds_count", me] == stats["steps_total"]
        assert got["pdserve:engine_step_tokens_count", me] == stats["steps_total"]
        assert got["pdserve:engine_step_seconds_sum", me] == pytest.approx(sum(s for s, _ in seen))
        assert got["pdserve:engine_preemptions_total", me] == stats["preemptions_total"]
        assert got["pdserve:engine_free_kv_blocks", me] == stats["free_blocks"] == 8
        assert got["pdserve:engine_requests_running", me] == 0

        assert httpx.get(url, timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.get(url, headers=wrong, timeout=10).status_code == 401
        assert httpx.get(f"http://{address}/other", headers=auth, timeout=10).status_code == 404
    finally:
        worker.stop()
    # stopped: the port is closed
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, headers=auth, timeout=5)
