"""The router closed: API keys and TLS on both front ends, against a real cluster that
``pdserve up`` serves in a process of its own (tests/router/secured.py): without a key
or with a wrong one, 401 and UNAUTHENTICATED (health stays open); the official
``openai`` client and ``RouterClient`` with a key and the test CA work; plain-text
connections are refused; an Abort with another key ends nothing; one key holds at most
``router.max_concurrent_requests_per_key`` calls; the CLI passes the key and the CA."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys

import grpc
import httpx
import openai
import pytest

from pdserve.router.client import RouterClient
from tests.cluster.helpers import refusals
from tests.router import secured

ALPHA, BETA = secured.KEYS
PER_KEY = 2
LONG = dict(prompt_token_ids=[7] * 20, max_tokens=900, ignore_eos=True)


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    s = secured.start(
        chat_model, tmp_path_factory.mktemp("secured"), max_concurrent_requests_per_key=PER_KEY
    )
    yield s
    assert secured.stop(s.process) == 0, "".join(s.output)


@pytest.fixture(scope="module")
def alpha(server):
    with RouterClient(server.address, api_key=ALPHA, ca_file=server.ca_file) as c:
        yield c


def _ca(server) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=server.ca_file)


def _openai(server, key: str) -> openai.OpenAI:
    http = httpx.Client(verify=_ca(server))
    return openai.OpenAI(base_url=server.base_url, api_key=key, http_client=http, max_retries=0)


def _refused(server, reason: str) -> float:
    """``pdserve:requests_refused_total`` of ``reason``, scraped with a key."""
    r = httpx.get(
        server.base_url.removesuffix("/v1") + "/metrics",
        headers={"Authorization": f"Bearer {BETA}"},
        verify=_ca(server),
    )
    return refusals(r.text, reason)


def test_http_without_a_known_key_is_401_in_openais_shape_and_health_is_open(server):
    before = _refused(server, "unauthenticated")
    with httpx.Client(base_url=server.base_url.removesuffix("/v1"), verify=_ca(server)) as h:
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": ALPHA}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                r = h.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                error = r.json()["error"]
                assert error["code"] == 401 and "API key" in error["message"]
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert h.get("/metrics").status_code == 401
        assert h.get("/health").status_code == 200
        key = {"Authorization": f"Bearer {BETA}"}
        assert h.get("/metrics", headers=key).status_code == 200
    assert _refused(server, "unauthenticated") - before == 7  # counted on /metrics


def test_grpc_without_a_known_key_is_unauthenticated_and_health_is_open(server):
    before = _refused(server, "unauthenticated")
    for key in (None, "wrong-key"):
        with RouterClient(server.address, api_key=key, ca_file=server.ca_file) as c:
            calls = (
                lambda c=c: c.complete("hi", max_tokens=2),
                lambda c=c: c.stats(),
                lambda c=c: c.abort("anything"),
            )
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "API key" in err.value.details()
            assert c.health() == "SERVING"
    assert _refused(server, "unauthenticated") - before == 6


def test_the_openai_client_with_the_key_and_the_ca_works(server, chat_model):
    with _openai(server, BETA) as api:
        assert [m.id for m in api.models.list().data] == [chat_model]
        done = api.chat.completions.create(
            model=chat_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert done.usage.completion_tokens >= 1
        chunks = list(
            api.completions.create(model=chat_model, prompt="Hi", max_tokens=3, stream=True)
        )
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    with _openai(server, "wrong") as api, pytest.raises(openai.AuthenticationError):
        api.models.list()


def test_router_client_with_the_key_and_the_ca_works(alpha):
    done = alpha.complete(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
    assert done.completion_tokens == 4 and done.finish_reason == "length"
    assert alpha.stats().max_queue == 16

    async def run():
        out = await alpha.acomplete("Hello", max_tokens=3, ignore_eos=True)
        await alpha.aclose()
        return out

    assert asyncio.run(run()).completion_tokens == 3


def test_plain_text_is_refused_on_both_ports(server):
    host, port = server.address.rsplit(":", 1)
    with RouterClient(server.address) as plain, pytest.raises(grpc.RpcError) as err:
        plain.health(timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{host}:{server.http_port}/health", timeout=5)
    # TLS with a CA that did not sign the router's certificate: refused too
    with RouterClient(server.address, tls=True) as untrusted, pytest.raises(grpc.RpcError):
        untrusted.health(timeout=5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"https://{host}:{server.http_port}/health", timeout=5)


def test_an_abort_with_another_key_ends_nothing(server, alpha):
    with RouterClient(server.address, api_key=BETA, ca_file=server.ca_file) as beta:
        stream = alpha.generate(**LONG, request_id="owned-by-alpha")
        first = next(stream)
        assert not beta.abort("owned-by-alpha")  # as for an id that does not exist
        assert not beta.abort("no-such-request")
        more = next(stream)
        assert first.finish_reason is None and more.finish_reason is None
        # its owner's abort ends it, unless the tiny model finished first on a loaded host
        aborted = alpha.abort("owned-by-alpha")
        assert [c.finish_reason for c in stream][-1] == ("abort" if aborted else "length")


async def _ended(client: RouterClient) -> bool:
    """Whether a held stream has ended at the router (its slot is free again): fewer
    than PER_KEY requests in flight there. The client's call may not be done yet: the
    router sent the last tokens, which the test has not read."""
    return (await client.astats()).in_flight < PER_KEY


async def _over_the_bound(server, a: RouterClient, b: RouterClient) -> int | None:
    """With PER_KEY streams of ``a``'s key in progress, a further call of that key over
    gRPC and over HTTP is refused and another key's is served. Returns the refusals
    seen, or None when a held stream ended before the check (the tiny model's 900
    tokens can finish inside a stall of a loaded host): the check did not happen."""
    held = [a.agenerate(**LONG) for _ in range(PER_KEY)]
    try:
        for s in held:  # each in progress at the router
            assert (await s.__anext__()).finish_reason is None
        try:
            await a.acomplete(prompt_token_ids=[5], max_tokens=1)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"router.max_concurrent_requests_per_key={PER_KEY}" in err.details()
        else:
            assert await _ended(b), "a third call of one key ran while two were in progress"
            return None
        async with httpx.AsyncClient(verify=_ca(server)) as h:
            r = await h.post(
                f"{server.base_url}/completions",
                json={"prompt": [5], "max_tokens": 1},
                headers={"Authorization": f"Bearer {ALPHA}"},
            )
        if r.status_code != 429:
            assert r.status_code == 200 and await _ended(b), r.text
            return 1
        assert "per_key" in r.json()["error"]["message"]
        done = await b.acomplete(prompt_token_ids=[5], max_tokens=1)  # another key: served
        assert done.completion_tokens == 1
        return 2
    finally:
        for s in held:
            s.cancel()


def test_one_key_holds_at_most_its_share_of_calls(server):
    before = _refused(server, "concurrency_per_key")

    async def run() -> list[int | None]:
        a = RouterClient(server.address, api_key=ALPHA, ca_file=server.ca_file)
        b = RouterClient(server.address, api_key=BETA, ca_file=server.ca_file)
        seen: list[int | None] = []
        try:
            while len(seen) < 3 and (not seen or seen[-1] != 2):
                seen.append(await _over_the_bound(server, a, b))
        finally:
            await a.aclose()
            await b.aclose()
        return seen

    seen = asyncio.run(run())
    assert seen[-1] == 2, f"the bound was never checked with both streams held: {seen}"
    assert _refused(server, "concurrency_per_key") - before == sum(n or 0 for n in seen)


def test_the_cli_passes_the_key_and_the_ca(server):
    def cli(*args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        command = [sys.executable, "-m", "pdserve.cluster.cli", *args, "--router", server.address]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)

    ok = cli("stats", "--api-key", ALPHA, "--ca-file", server.ca_file)
    assert ok.returncode == 0 and "queued 0/16" in ok.stdout, ok.stderr
    out = cli("generate", "Hi", "--max-tokens", "3", "--api-key", BETA, "--ca-file", server.ca_file)
    assert out.returncode == 0 and "finish " in out.stdout, out.stderr
    refused = cli("stats", "--ca-file", server.ca_file)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def test_the_cluster_handle_s_client_brings_the_key_and_tls(server, monkeypatch):
    from pdserve.cluster.config_loader import load_config
    from pdserve.cluster.launcher import Cluster

    config = load_config(server.folder / "secured.yaml")
    monkeypatch.setenv("PDSERVE_CA_FILE", server.ca_file)
    with Cluster(config, session=None, address=server.address).client() as c:
        assert c.stats().max_queue == 16
