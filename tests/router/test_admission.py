"""Refusals through a real router: INVALID_ARGUMENT with a reason, RESOURCE_EXHAUSTED
(gRPC, with trailing metadata retry-after) and 429 (HTTP, with Retry-After, in
OpenAI's error shape) when the admission queue is full; the server keeps serving
after either."""

from __future__ import annotations

import grpc
import httpx
import pytest

from tests.cluster.helpers import all_blocks_free, fill_then_refuse, wait_until

INVALID = [
    ("empty prompt", dict(prompt=""), "prompt: empty"),
    ("empty token ids", dict(prompt_token_ids=[]), "prompt: empty"),
    ("no messages", dict(messages=[]), "messages: empty"),
    ("longer than the context", dict(prompt_token_ids=[5] * 1024), "the context holds 1024"),
    ("token id out of vocab", dict(prompt_token_ids=[5, 256]), "[0, 256)"),
    ("max_tokens 0", dict(prompt="hi", max_tokens=0), "max_tokens=0"),
    ("max_tokens negative", dict(prompt="hi", max_tokens=-3), "max_tokens=-3"),
    ("temperature < 0", dict(prompt="hi", temperature=-0.5), "temperature=-0.5"),
    ("top_p 0", dict(prompt="hi", top_p=0.0), "top_p=0.0"),
    ("top_p above 1", dict(prompt="hi", top_p=1.5), "top_p=1.5"),
    ("top_k below -1", dict(prompt="hi", top_k=-2), "top_k=-2"),
    ("empty stop string", dict(prompt="hi", stop=[""]), "stop="),
]


@pytest.mark.parametrize("case,kwargs,needle", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_request(client, case, kwargs, needle):
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(**kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()


def test_still_serving_after_invalid_requests(client):
    done = client.complete("hi", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4 and done.finish_reason == "length"
    assert all_blocks_free(client.stats())


def test_full_admission_queue_is_refused_then_serving_resumes(cluster, client):
    capacity = 2 * 8  # instances x max_batch_size: sent to instances
    max_queue = client.stats().max_queue  # waiting at the router

    def check(stats):
        assert all(i.outstanding == 8 for i in stats.instances)
        r = httpx.post(f"http://{cluster.http_address}/v1/completions",
                       json={"prompt": [7, 8], "max_tokens": 1}, timeout=10)  # fmt: skip
        assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
        error = r.json()["error"]
        assert error["code"] == 429 and error["type"] == "rate_limit_error"
        assert "admission queue full" in error["message"]

    fill_then_refuse(client, [7] * 20, capacity, max_queue, check)
    assert wait_until(lambda: all_blocks_free(client.stats()), timeout_s=2.0)
    done = client.complete("back to normal", max_tokens=3, ignore_eos=True)
    assert len(done.token_ids) == 3
