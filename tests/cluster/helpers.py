"""Helpers shared by the cluster and router tests: a tiny chat model, a small cluster."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.tiny_models import TINY_SHAPES, save_tiny_chat_llama


def make_chat_model(folder: Path) -> str:
    """The ``gqa2`` tiny Llama (4 heads, 2 KV heads, context 1024) with a byte tokenizer."""
    save_tiny_chat_llama(folder, **TINY_SHAPES["gqa2"])
    return str(folder)


def small_cluster_config(model: str, **router) -> dict:
    """Two co-located instances of 1 CPU on an embedded Ray; the router on a free port.

    8 requests per instance at once and 16 waiting at the router, so that tests can
    fill the admission queue."""
    return {
        "model": model,
        "mode": "colocated",
        "router": {"host": "127.0.0.1", "port": 0, "http_port": 0, "max_queue": 16, **router},
        "colocated": {
            "instances": 2,
            "max_batch_size": 8,
            "max_batch_tokens": 256,
            "kv_blocks": 512,
            "block_size": 16,
            "resources": {"num_cpus": 1},
        },
    }


def ray_temp_dirs(base: str | Path) -> list[str]:
    """Embedded Ray folders under ``base`` (the tests point ``PDSERVE_RAY_TMPDIR`` there)."""
    return sorted(n for n in os.listdir(base) if n.startswith("pdserve-ray-"))


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02):
    """Poll ``predicate`` until it returns a truthy value; that value, or None at timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def all_blocks_free(stats) -> bool:
    return stats.in_flight == 0 and all(i.free_blocks == i.total_blocks for i in stats.instances)


def seconds_until_blocks_free(cluster, within_s: float = 10.0) -> float:
    """Seconds until every instance's block manager passes ``check_integrity()`` with
    every block free, asked on each instance's loop (an abort still on its way there is
    waited for, not missed); fails the test past ``within_s``."""
    import ray

    started = time.monotonic()

    def blocks():
        return {n: ray.get(h.check_integrity.remote()) for n, h in cluster.workers.items()}

    def free():
        return all(b["free_blocks"] == b["total_blocks"] for b in blocks().values())

    assert wait_until(free, within_s, interval_s=0.05), blocks()
    return time.monotonic() - started


def fill_then_refuse(client, prompt_ids: list[int], sent: int, max_queue: int, check) -> None:
    """Start ``sent + max_queue`` long streams, wait until ``max_queue`` of them wait at
    the router, run ``check(stats)``, and expect one more request to be refused with
    RESOURCE_EXHAUSTED; then cancel them all."""
    import asyncio

    import grpc
    import pytest

    async def main():
        streams = [
            client.agenerate(prompt_token_ids=prompt_ids, max_tokens=900, ignore_eos=True)
            for _ in range(sent + max_queue)
        ]
        readers = [asyncio.ensure_future(s.__anext__()) for s in streams]
        try:
            for _ in range(500):
                stats = await client.astats()
                if stats.queued == max_queue:
                    break
                await asyncio.sleep(0.01)
            assert stats.queued == max_queue and stats.in_flight == sent + max_queue, stats
            check(stats)
            with pytest.raises(grpc.RpcError) as err:
                await client.acomplete(prompt_token_ids=prompt_ids, max_tokens=1)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "admission queue full" in err.value.details()
            assert ("retry-after", "1") in tuple(err.value.trailing_metadata())
        finally:
            for s in streams:
                s.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            await client.aclose()

    asyncio.run(main())


def refusals(metrics_text: str, reason: str) -> float:
    """``pdserve:requests_refused_total`` of ``reason`` in a /metrics page (read with
    Prometheus' own parser); AssertionError when the page has no such series."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if (
                sample.name == "pdserve:requests_refused_total"
                and sample.labels["reason"] == reason
            ):
                return sample.value
    raise AssertionError(f"no refusals of reason {reason!r}")
