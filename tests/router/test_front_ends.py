"""The two front ends' translations, without a cluster: protobuf and OpenAI JSON into
the core's ``GenerateRequest``, the core's ``Timings`` into protobuf, and every kind
of refusal mapped by both."""

from __future__ import annotations

import re

import grpc
import pytest

from pdserve.router.client import make_request
from pdserve.router.grpc_api import GRPC_STATUS, generate_request, timings_message
from pdserve.router.openai_request import BadRequest, read_request
from pdserve.router.openai_shapes import HTTP_STATUS
from pdserve.router.request import ChatMessage, GenerateRequest, Refusal, SamplingOptions
from pdserve.router.stream import Phases, Timings


def test_every_refusal_has_a_grpc_and_an_http_status():
    assert set(GRPC_STATUS) == set(HTTP_STATUS) == set(Refusal)
    assert GRPC_STATUS[Refusal.BUSY] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert HTTP_STATUS[Refusal.BUSY] == 429


def test_grpc_request_keeps_the_input_given_and_leaves_unset_sampling_unset():
    req = generate_request(make_request("hi", max_tokens=3, stop="x", request_id="r"))
    assert req == GenerateRequest(
        prompt="hi", sampling=SamplingOptions(max_tokens=3, stop=["x"]), request_id="r"
    )
    assert generate_request(make_request(messages=[])).messages == []
    assert generate_request(make_request(prompt_token_ids=[])).prompt_token_ids == []
    chat = generate_request(make_request(messages=[{"role": "user", "content": "a"}]))
    assert chat.messages == [ChatMessage("user", "a")] and chat.inputs_given() == ["messages"]
    assert generate_request(make_request(prompt="", temperature=0)).sampling.temperature == 0.0


def test_timings_become_the_protobuf_message_field_by_field():
    t = Timings(1.5, 2.0, 0.5, 9.0, ["prefill-0", "decode-1"], 4096, 32, 0.75, 2)
    t.phases = Phases(queued=0.1, transfer_end=3.0, tokens=[2.0, 2.5], finish=2.5)
    msg = timings_message(t)
    assert (msg.queue_ms, msg.ttft_ms, msg.tpot_ms, msg.e2e_ms) == (1.5, 2.0, 0.5, 9.0)
    assert list(msg.instances) == ["prefill-0", "decode-1"] and msg.attempts == 2
    assert (msg.kv_bytes, msg.kv_cached_tokens, msg.transfer_ms) == (4096, 32, 0.75)
    assert (msg.phases.queued, msg.phases.transfer_end, msg.phases.finish) == (0.1, 3.0, 2.5)
    assert list(msg.phases.tokens) == [2.0, 2.5] and msg.phases.prefill_start == 0


def http_request(body: dict, chat: bool) -> GenerateRequest:
    return read_request(body, chat).request


def test_openai_bodies_become_core_requests():
    req = http_request({"prompt": [[5, 6]], "temperature": 0, "stop": "x", "seed": 7}, False)
    assert req.prompt_token_ids == [5, 6] and req.sampling.temperature == 0.0
    assert (req.sampling.stop, req.sampling.seed, req.sampling.max_tokens) == (["x"], 7, None)
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "!"}]
    chat = http_request({"messages": [{"role": "user", "content": parts}]}, True)
    assert chat.messages == [ChatMessage("user", "Hi !")] and chat.sampling.max_tokens == 512


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"prompt": "a", "max_tokens": "5"}, "max_tokens='5': must be an integer"),
        ({"prompt": "a", "max_tokens": 2.0}, "max_tokens=2.0: must be an integer"),
        ({"prompt": "a", "temperature": "hot"}, "temperature='hot': must be a number"),
        ({"prompt": "a", "stop": [1]}, "stop=[1]: must be a string or a list of strings"),
        ({"prompt": "a", "stop_token_ids": ["a"]}, "stop_token_ids=['a']: must be a list"),
        ({"prompt": "a", "n": 2.0}, "n=2.0: must be an integer"),
        ({"prompt": ["a", "b"]}, "one string or one list of token ids"),
        ({"prompt": "a", "logit_bias": None, "nope": None}, "nope: unknown field"),
        ({"prompt": "a", "stop_token_ids": False}, "stop_token_ids=False: must be a list"),
        ({"messages": [{"role": "user", "content": "a", "x": None}]}, "messages[0].x: unknown"),
    ],
)
def test_openai_bodies_of_the_wrong_types_are_bad_requests(body, needle):
    with pytest.raises(BadRequest, match=re.escape(needle)):
        http_request(body, chat="messages" in body)
