"""The OpenAI-compatible HTTP API, checked with the official ``openai`` client against a
real cluster: the same tokens as the offline engine, streaming and not, completions
and chat; errors in OpenAI's shape; /health and /metrics; ``pdserve bench``'s endpoint
client measuring our own server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine import LLM, SamplingParams

IDS = [5, 9, 33, 81, 17, 4, 60]


@pytest.fixture(scope="module")
def offline(chat_model):
    return LLM(chat_model)


def test_models_lists_the_served_model(api, chat_model):
    assert [m.id for m in api.models.list().data] == [chat_model]


def test_completion_equals_offline_greedy(api, chat_model, offline):
    want = offline.generate(IDS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    got = api.completions.create(
        model=chat_model, prompt=IDS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(IDS), 8)
    chunks = list(
        api.completions.create(
            model=chat_model,
            prompt=IDS,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices


def test_chat_equals_offline_chat(api, chat_model, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = offline.chat(messages, params)[0].text
    kw = dict(model=chat_model, messages=messages, max_tokens=10, temperature=0)
    got = api.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    stream = api.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_invalid_requests_are_400_in_openai_shape(api, chat_model):
    with pytest.raises(openai.BadRequestError, match="max_tokens=0"):
        api.completions.create(model=chat_model, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="temperature=-1"):
        api.chat.completions.create(
            model=chat_model, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    with pytest.raises(openai.BadRequestError, match="one string or one list of token ids"):
        api.completions.create(model=chat_model, prompt=["a", "b"], max_tokens=2)


def test_health_and_prometheus_metrics(cluster):
    base = f"http://{cluster.http_address}"
    assert httpx.get(f"{base}/health").status_code == 200
    resp = httpx.get(f"{base}/metrics")
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    assert families["pdserve:num_requests_in_flight"].type == "gauge"
    samples = {
        (s.name, s.labels.get("instance")): s.value for f in families.values() for s in f.samples
    }
    assert samples[("pdserve:instance_up", "colocated-0")] == 1
    assert samples[("pdserve:instance_kv_blocks", "colocated-1")] == 512
    assert families["pdserve:time_to_first_token_seconds"].type == "histogram"


def test_bench_endpoint_client_measures_our_server(cluster):
    from pdserve.loadgen.endpoint import EndpointClient
    from pdserve.loadgen.metrics import Record
    from pdserve.loadgen.workloads import Request

    client = EndpointClient(f"http://{cluster.http_address}")
    record = Record(index=0, sent_s=0.0, prompt_tokens=len(IDS), output_len=6)

    async def run():
        try:
            await client.fill(record, Request(0.0, IDS, 6), timeout_s=60)
        finally:
            await client.aclose()

    asyncio.run(run())
    assert record.error is None and record.completion_tokens == 6
    assert 0 < record.ttft_ms <= record.e2e_ms and record.finish_reason == "length"


HOSTILE = {"temperature": ["NaN", "Infinity", "-Infinity", "1e-40", "-0.0"],
           "top_p": ["NaN", "-0.0", "Infinity"]}  # fmt: skip


def test_hostile_sampling_values_fail_alone(cluster, chat_model, offline):
    """Non-finite, denormal and negative-zero sampling values, over HTTP (where NaN and
    Infinity are not JSON) and gRPC, are refused at the edge (400 / INVALID_ARGUMENT,
    naming the field and no traceback) while four greedy streams run on the same
    instances; those finish intact."""
    import grpc

    from pdserve.router.client import RouterClient

    prompts = [[5 + i, 9, 33, 81] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in offline.generate(prompts, params)]
    client = RouterClient(cluster.address)

    async def run():
        streams = [
            asyncio.ensure_future(client.acomplete(prompt_token_ids=ids, max_tokens=40,
                                                   temperature=0, ignore_eos=True))
            for ids in prompts
        ]  # fmt: skip
        async with httpx.AsyncClient(base_url=f"http://{cluster.http_address}") as http:
            for key, values in HOSTILE.items():
                for value in values:
                    body = f'{{"model": "{chat_model}", "prompt": [5, 9], "{key}": {value}}}'
                    r = await http.post("/v1/completions", content=body,
                                        headers={"Content-Type": "application/json"})  # fmt: skip
                    assert r.status_code == 400, (key, value, r.text)
                    message = r.json()["error"]["message"]
                    # JSON has no NaN or Infinity: such a body is refused as it is read
                    literal = value.lstrip("-") in ("NaN", "Infinity")
                    want = f"{value} is not a JSON number" if literal else f"sampling.{key}="
                    assert want in message and "Traceback" not in message
                    with pytest.raises(grpc.RpcError) as err:
                        await client.acomplete(prompt_token_ids=[5, 9], **{key: float(value)})
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (key, value)
        done = [c.token_ids for c in await asyncio.gather(*streams)]
        await client.aclose()
        return done

    try:
        assert asyncio.run(run()) == want
    finally:
        client.close()
