"""Overload on a cluster of its own (2 instances x 4 requests, router.queue_timeout_s
0.5, router.max_concurrent_requests 10): a request still queued past the timeout (both
instances full, their step loops held asleep) is refused (429 with Retry-After /
RESOURCE_EXHAUSTED with retry-after); a call past the bound is refused at once, before
the core sees it, while Health, Stats and /health still answer; afterwards every block
is free and the cluster serves."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import httpx
import pytest
import ray

from pdserve.cluster import launch
from tests.cluster.helpers import seconds_until_blocks_free, small_cluster_config, wait_until

QUEUE_TIMEOUT_S, MAX_CALLS, RUNNING = 0.5, 10, 8
LONG = dict(prompt_token_ids=[7] * 20, max_tokens=900, ignore_eos=True)  # over 1 s each here


@pytest.fixture(scope="module")
def cluster(chat_model):
    config = small_cluster_config(
        chat_model, queue_timeout_s=QUEUE_TIMEOUT_S, max_concurrent_requests=MAX_CALLS
    )
    config["colocated"]["max_batch_size"] = RUNNING // 2
    with launch(config) as c:
        yield c


async def _hold(client, n: int):
    """``n`` long streams, each started (admitted: running or queued); their readers."""
    streams = [client.agenerate(**LONG) for _ in range(n)]
    readers = [asyncio.ensure_future(s.__anext__()) for s in streams]
    for _ in range(500):
        if (await client.astats()).in_flight == n:
            break
        await asyncio.sleep(0.01)
    return streams, readers


async def _release(streams, readers) -> None:
    for s in streams:
        s.cancel()
    await asyncio.gather(*readers, return_exceptions=True)


def test_queued_past_the_timeout_is_refused_with_retry_after(cluster):
    client = cluster.client()
    http = httpx.AsyncClient(base_url=f"http://{cluster.http_address}", timeout=30)
    workers = list(cluster.workers.values())

    async def run():
        held = await _hold(client, RUNNING)
        # both instances' step loops sleep: no held request ends (and frees its place)
        # before the timeout, however fast the machine decodes
        paused = [h.on_loop.remote(time.sleep, 3 * QUEUE_TIMEOUT_S) for h in workers]
        try:
            started = time.monotonic()
            over_http = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            over_grpc = client.acomplete(prompt_token_ids=[5, 6], max_tokens=2)
            r, err = await asyncio.gather(over_http, over_grpc, return_exceptions=True)
            waited = time.monotonic() - started
        finally:
            await _release(*held)
            await client.aclose()
            await http.aclose()
            ray.get(paused, timeout=30)
        return r, err, waited

    r, err, waited = asyncio.run(run())
    assert QUEUE_TIMEOUT_S * 0.9 < waited < QUEUE_TIMEOUT_S + 5
    assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
    assert "router.queue_timeout_s=0.5" in r.json()["error"]["message"]
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "router.queue_timeout_s=0.5" in err.details()
    assert ("retry-after", "1") in tuple(err.trailing_metadata())
    seconds_until_blocks_free(cluster)
    assert len(client.complete(prompt_token_ids=[5, 6], max_tokens=2).token_ids) == 2


def _slow_body(address: str) -> socket.socket:
    """A POST whose body never comes: its call is in progress, its handler reading."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip
    return sock


def test_calls_past_the_bound_are_refused_at_once_and_health_answers(cluster):
    client = cluster.client()
    socks = [_slow_body(cluster.http_address) for _ in range(MAX_CALLS)]
    try:
        base = f"http://{cluster.http_address}"
        time.sleep(0.5)  # the router has taken every call
        started = time.monotonic()
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        with pytest.raises(grpc.RpcError) as err:
            client.complete(prompt_token_ids=[5, 6], max_tokens=2)
        refused_in = time.monotonic() - started
        assert httpx.get(f"{base}/health").status_code == 200
        assert client.health() == "SERVING" and client.stats().in_flight == 0
    finally:
        for sock in socks:
            sock.close()
    print(f"two calls past the bound refused in {refused_in:.3f} s")
    assert refused_in < 2.0
    assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
    assert "router.max_concurrent_requests" in r.json()["error"]["message"]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "router.max_concurrent_requests" in err.value.details()
    assert ("retry-after", "1") in tuple(err.value.trailing_metadata())
    done = wait_until(lambda: _completes(client), timeout_s=5.0)  # the places came back
    assert done and len(done.token_ids) == 2


def _completes(client):
    try:
        return client.complete(prompt_token_ids=[5, 6], max_tokens=2)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return None
