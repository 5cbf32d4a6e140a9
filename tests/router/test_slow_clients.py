"""What a client can hold of the router (docs/serving.md, "Authentication, TLS and
limits"), on the folder's cluster (tests/router/conftest.py: the router's default
bounds, the tiny chat model; a second cluster in this process would clash with its
named actors):

- 4,100 slow-body connections (tests/router/slow_clients.py, a process of its own,
  connecting from 127.0.0.2; fewer if its open files do not allow as many) take at most
  ``router.max_concurrent_requests_per_address`` generate places, the rest refused at
  once (429); meanwhile a well-behaved client on 127.0.0.1 streams a greedy completion
  within twice its unloaded time, gRPC serves and /health is 200.
- Four 4 MiB prompts (one of them a chat message) are refused from their length,
  before tokenization, and delay a tiny request behind them by less than 0.5 s.
- A ``request_id`` past ``router.max_request_id_chars`` is refused naming the field,
  its length and the bound.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from pdserve.cluster.config import RouterConfig
from tests.cluster.helpers import refusals, wait_until

DEFAULTS = RouterConfig()
SLOW_CLIENTS = 4100
ATTACKER = "127.0.0.2"  # loopback too: the per-address bound tells it from 127.0.0.1
GREEDY = {"prompt": "hello there", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
HUGE = 4 * 2**20
# a greedy stream beside the slow bodies may take this much longer than alone: a stalled
# router would hold it up to body_timeout_s (60 s by default)
STALL_S = 5.0


def _refused(http: httpx.Client, reason: str) -> float:
    return refusals(http.get("/metrics").text, reason)


def _greedy_stream(http: httpx.Client) -> tuple[float, str]:
    """Seconds a streamed greedy completion takes, and its text."""
    started, text = time.monotonic(), ""
    with http.stream("POST", "/v1/completions", json={**GREEDY, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
    return time.monotonic() - started, text


def _times(http: httpx.Client, runs: int = 3) -> tuple[float, set[str]]:
    """The median time of ``runs`` greedy streams, and their texts."""
    done = [_greedy_stream(http) for _ in range(runs)]
    return statistics.median(t for t, _ in done), {text for _, text in done}


@pytest.mark.timeout(300)
def test_slow_body_connections_leave_other_clients_served(cluster):
    host, port = cluster.http_address.rsplit(":", 1)
    http = httpx.Client(base_url=f"http://{cluster.http_address}", timeout=60)
    client = cluster.client()
    _greedy_stream(http)  # warm: the first stream compiles nothing later ones do not
    unloaded, texts = _times(http)
    before = _refused(http, "concurrency_per_address")
    slow = subprocess.Popen(
        [sys.executable, "-m", "tests.router.slow_clients", host, port, str(SLOW_CLIENTS),
         ATTACKER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        opened = int(re.fullmatch(r"open (\d+)\n", slow.stdout.readline()).group(1))
        print(f"slow-body connections held open: {opened}")
        assert opened > DEFAULTS.max_concurrent_requests_per_address
        over = opened - DEFAULTS.max_concurrent_requests_per_address

        def refused_so_far():
            return _refused(http, "concurrency_per_address") - before >= over

        assert wait_until(refused_so_far, 60, interval_s=0.2)
        loaded, loaded_texts = _times(http)
        assert slow.poll() is None  # the slow clients still hold their connections
        assert http.get("/health").status_code == 200
        done = client.complete(prompt_token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 8
        refused = _refused(http, "concurrency_per_address") - before
    finally:
        slow.stdin.close()
        slow.wait(timeout=60)
        client.close()
    print(f"greedy stream: {unloaded:.3f} s unloaded, {loaded:.3f} s beside them")
    assert refused == over  # the others hold a place each, waiting for their bodies
    assert loaded_texts == texts  # greedy: the same completion, attack or not
    assert loaded < unloaded + STALL_S, (loaded, unloaded)
    http.close()


@pytest.mark.timeout(120)
def test_huge_prompts_are_refused_before_tokenization_and_delay_nobody(cluster):
    http = httpx.AsyncClient(base_url=f"http://{cluster.http_address}", timeout=60)
    client = cluster.client()
    tiny = dict(prompt_token_ids=[5, 6], max_tokens=1)

    async def timed(call) -> float:
        started = time.monotonic()
        await call
        return time.monotonic() - started

    async def run():
        try:
            await client.acomplete(**tiny)  # warm
            alone = min([await timed(client.acomplete(**tiny)) for _ in range(3)])
            huge = "a" * HUGE
            chat = {"messages": [{"role": "user", "content": huge}]}
            bodies = [
                http.post("/v1/completions", json={"prompt": huge}),
                http.post("/v1/chat/completions", json=chat),
            ]
            calls = [client.acomplete(huge, max_tokens=1) for _ in range(2)]
            refusals = [asyncio.ensure_future(c) for c in (*bodies, *calls)]
            await asyncio.sleep(0.05)  # the huge ones arrive first
            behind = await timed(client.acomplete(**tiny))
            answers = await asyncio.gather(*refusals, return_exceptions=True)
        finally:
            await http.aclose()
            await client.aclose()
        return alone, behind, answers

    alone, behind, answers = asyncio.run(run())
    print(f"tiny request: {alone:.3f} s alone, {behind:.3f} s behind four 4 MiB prompts")
    words = (f"prompt: {HUGE} characters, more than ", "refused before tokenization")
    chat = answers[1]
    assert chat.status_code == 400, chat.text
    assert "characters, more than 1023 tokens" in chat.json()["error"]["message"], chat.text
    for r in answers[:1]:
        assert r.status_code == 400, r.text
        assert all(w in r.json()["error"]["message"] for w in words), r.text
    for err in answers[2:]:
        assert isinstance(err, grpc.RpcError), err
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(w in err.details() for w in words), err.details()
    assert behind - alone < 0.5, (behind, alone)


def test_a_request_id_past_the_bound_is_refused_naming_it(cluster):
    client = cluster.client()
    bound = DEFAULTS.max_request_id_chars
    try:
        for chars in (bound + 1, 2**20):
            with pytest.raises(grpc.RpcError) as err:
                client.complete(prompt_token_ids=[5], max_tokens=1, request_id="r" * chars)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == (
                f"request_id: {chars} characters, past router.max_request_id_chars={bound}"
            )
        done = client.complete(prompt_token_ids=[5], max_tokens=1, request_id="r" * bound)
        assert done.request_id == "r" * bound
    finally:
        client.close()
