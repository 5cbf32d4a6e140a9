"""The router's limits at their defaults (cluster/config.py), on the package's cluster:
each refused with a message naming the key, the value and the bound, over HTTP (413 for
a body, 400 for the rest) and gRPC; the cluster serves on afterwards."""

from __future__ import annotations

import grpc
import httpx
import pytest

from pdserve.cluster.config import RouterConfig

DEFAULTS = RouterConfig()


def _refused(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_stop_strings_past_their_count_or_length_are_refused(http, client):
    many = [f"s{i}" for i in range(DEFAULTS.max_stop_strings + 1)]
    long = "x" * (DEFAULTS.max_stop_string_chars + 1)
    count = f"router.max_stop_strings={DEFAULTS.max_stop_strings}"
    length = f"router.max_stop_string_chars={DEFAULTS.max_stop_string_chars}"
    r = http.post("/v1/completions", json={"prompt": "hi", "stop": many})
    _refused(r, 400, f"stop: {len(many)} stop strings", count)
    r = http.post("/v1/completions", json={"prompt": "hi", "stop": ["ok", long]})
    _refused(r, 400, f"stop[1]: {len(long)} characters", length)
    for stop, bound in ((many, count), ([long], length)):
        with pytest.raises(grpc.RpcError) as err:
            client.complete("hi", stop=stop)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bound in err.value.details()
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": many[:-1]})
    assert ok.status_code == 200, ok.text


def test_a_body_past_the_bound_is_413_and_a_grpc_message_resource_exhausted(http, client):
    size = DEFAULTS.max_body_bytes + 1
    body = b'{"prompt": "' + b"a" * (size - 15) + b'"}'
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    _refused(r, 413, f"{len(body)} bytes", f"router.max_body_bytes={DEFAULTS.max_body_bytes}")
    with pytest.raises(grpc.RpcError) as err:
        client.complete("a" * (DEFAULTS.max_message_bytes + 1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(DEFAULTS.max_message_bytes) in err.value.details()


def test_a_prompt_past_the_context_is_refused_naming_both(http, client):
    r = http.post("/v1/completions", json={"prompt": [5] * 1024, "max_tokens": 1})
    _refused(r, 400, "prompt: 1024 tokens", "the context holds 1024")
    done = client.complete(prompt_token_ids=[5, 6], max_tokens=2, ignore_eos=True)
    assert done.completion_tokens == 2
