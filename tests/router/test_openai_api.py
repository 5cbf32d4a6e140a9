"""The OpenAI API says what it does, against the real cluster of this folder: an unknown
model is a 404 in OpenAI's shape; every field pdserve does not implement is refused
with a 400 naming it, or accepted at the value that asks for what pdserve does; echo;
hostile bodies (deep nesting, invalid UTF-8, NaN, huge numbers, lone surrogates, roles
and parts the template cannot take) are 400s naming the problem, never a 500 or a
dropped connection; the same over gRPC for chat messages."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from pdserve.router.openai_fields import CHAT_FIXED, COMPLETIONS_FIXED

IDS = [5, 9, 33, 81]
# one value per unimplemented field that asks for what pdserve does not do
REFUSED = {"logit_bias": {"5": 10}, "suffix": "end",
           "functions": [{"name": "f"}], "function_call": "auto",
           "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
           "prediction": {"type": "content", "content": "x"}, "store": True}  # fmt: skip
ACCEPTED_CHAT = {"n": 1, "tools": [], "tool_choice": "none", "store": False, "logit_bias": {},
                 "response_format": {"type": "text"}, "modalities": ["text"], "user": "u-1",
                 "metadata": {"team": "a"}, "presence_penalty": 0,
                 "parallel_tool_calls": None}  # fmt: skip


def post(http, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and "Traceback" not in error["message"]
    return error


def completion(model: str, **kw) -> dict:
    return {"model": model, "prompt": IDS, "max_tokens": 2, "temperature": 0, **kw}


def chat(model: str, **kw) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0, **kw}


def test_unknown_model_is_404_in_openai_shape(http, cluster, chat_model):
    for path, body in (("/v1/completions", completion("gpt-4")), ("/v1/chat/completions",
                       chat("gpt-4"))):  # fmt: skip
        error = error_of(post(http, path, body), 404)
        assert (error["type"], error["param"]) == ("NotFoundError", "model")
        assert "model='gpt-4': not served here" in error["message"]
    api = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused")
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.completions.create(model="nope", prompt="hi", max_tokens=1)
    api.close()
    # the served id, the same folder as an absolute path, and no model at all are served
    absolute = str(Path(chat_model).resolve())
    for model in (chat_model, absolute):
        assert post(http, "/v1/completions", completion(model)).status_code == 200
    no_model = completion(chat_model)
    del no_model["model"]
    assert post(http, "/v1/completions", no_model).json()["model"] == chat_model
    assert error_of(post(http, "/v1/completions", completion(7)), 400)["param"] == "model"


def test_every_unimplemented_field_is_refused_naming_it(http, chat_model):
    assert set(REFUSED) == set(CHAT_FIXED) | set(COMPLETIONS_FIXED)
    for chat_api, fixed in ((False, COMPLETIONS_FIXED), (True, CHAT_FIXED)):
        path = "/v1/chat/completions" if chat_api else "/v1/completions"
        make = chat if chat_api else completion
        for key in fixed:
            error = error_of(post(http, path, make(chat_model, **{key: REFUSED[key]})), 400)
            assert error["param"] == key and error["message"].startswith(f"{key}="), error
            assert "not supported" in error["message"], error
        error = error_of(post(http, path, make(chat_model, best_effort=True)), 400)
        assert error["param"] == "best_effort" and "unknown field" in error["message"]


def test_best_of_is_checked_against_n_and_streaming(http, chat_model):
    for fields, why in (
        (dict(n=3, best_of=2), "must be an integer in [n, 16] (n=3)"),
        (dict(best_of=17), "must be an integer in [n, 16] (n=1)"),
        (dict(best_of=2, stream=True), "cannot be streamed"),
        (dict(best_of=2, echo=True, logprobs=1), "prompt logprobs"),
        (dict(best_of=2, prompt_logprobs=0), "prompt logprobs"),
    ):
        error = error_of(post(http, "/v1/completions", completion(chat_model, **fields)), 400)
        assert error["param"] == "best_of" and why in error["message"], (fields, error)
    error = error_of(post(http, "/v1/completions", completion(chat_model, n=0, best_of=2)), 400)
    assert error["param"] == "n", error
    error = error_of(post(http, "/v1/chat/completions", chat(chat_model, best_of=2)), 400)
    assert error["param"] == "best_of" and "unknown field" in error["message"], error
    # echo without logprobs asks for no prompt logprobs: best_of's own logprobs do not
    r = post(http, "/v1/completions", completion(chat_model, best_of=2, echo=True))
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    # best_of == n asks for nothing more (streamed too)
    r = post(http, "/v1/completions", completion(chat_model, n=2, best_of=2, stream=True))
    assert r.status_code == 200, r.text


def test_the_values_that_ask_for_what_pdserve_does_are_served(http, chat_model):
    r = post(http, "/v1/chat/completions", chat(chat_model, **ACCEPTED_CHAT))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = post(http, "/v1/completions", completion(chat_model, n=1, best_of=1, suffix="", top_k=-1))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_echo_puts_the_prompt_before_the_completion(http, chat_model):
    plain = post(http, "/v1/completions", completion(chat_model, prompt="Hello")).json()
    text = plain["choices"][0]["text"]
    echoed = post(http, "/v1/completions", completion(chat_model, prompt="Hello", echo=True))
    assert echoed.json()["choices"][0]["text"] == "Hello" + text
    assert echoed.json()["usage"] == plain["usage"]
    ids = post(http, "/v1/completions", completion(chat_model, prompt=[72, 105], echo=True))
    assert ids.json()["choices"][0]["text"].startswith("Hi")
    body = completion(chat_model, prompt="Hello", echo=True, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] == "Hello"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "Hello" + text


HOSTILE = [
    (b"[" * 100_000 + b"]" * 100_000, "the body is nested too deeply"),
    (b'{"prompt": "caf\xe9"}', "the body is not UTF-8"),
    (b"[1, 2]", "the body must be a JSON object, got a JSON array"),
    (b'"hi"', "got a JSON string"),
    (b"", "the body is not valid JSON"),
    (b'{"prompt": "a", "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"prompt": "a", "top_p": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"prompt": "a", "max_tokens": 1e400}', "max_tokens=inf: must be an integer"),
    (b'{"prompt": "a", "seed": %d}' % 2**70, "sampling.seed=1180591620717411303424: must be"),
    (b'{"prompt": "a", "temperature": 1%s}' % (b"0" * 400), "temperature=1000"),
    (b'{"prompt": "a", "max_tokens": 1%s}' % (b"0" * 5000), "Exceeds the limit"),
    (b'{"prompt": "\\ud800"}', "prompt: holds a lone surrogate (U+D800)"),
    (b'{"prompt": "a", "stop": ' + b"[" * 500 + b"]" * 500 + b"}", "stop=[[[...]]]: must be"),
    (b'{"prompt": "a", "stream": "yes"}', "stream='yes': must be true or false"),
]
HOSTILE_CHAT = [
    ({"role": "wizard", "content": "hi"}, "messages[0].role='wizard': must be one of system"),
    ({"content": "hi"}, "messages[0].role=None: must be a string"),
    ({"role": "tool", "content": "4", "tool_call_id": 7}, "messages[0].tool_call_id: must be"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "messages[0].content[0]={'image_url': {'url': 'x'}, 'type': 'image_url'}: only text"),
    ({"role": "user", "content": 5}, "messages[0].content=5: must be a string"),
    ({"role": "user", "content": "hi", "name": "bob"}, "messages[0].name='bob': not supported"),
]  # fmt: skip


def test_hostile_bodies_are_400s_naming_the_problem(http, chat_model):
    for body, needle in HOSTILE:
        for path in ("/v1/completions", "/v1/chat/completions"):
            if path.endswith("chat/completions") and b'"prompt"' in body:
                continue
            error = error_of(post(http, path, body), 400)
            assert needle in error["message"], (body[:60], error)
    for message, needle in HOSTILE_CHAT:
        body = {"model": chat_model, "messages": [message], "max_tokens": 2}
        error = error_of(post(http, "/v1/chat/completions", body), 400)
        assert needle in error["message"], error
    # the server is still there, and aiohttp's own errors have OpenAI's shape too
    assert post(http, "/v1/completions", completion(chat_model)).status_code == 200
    assert error_of(http.get("/v1/nothing"), 404)["message"] == "GET /v1/nothing: Not Found"
    r = http.get("/v1/completions")
    assert error_of(r, 405) and r.headers["Allow"] == "POST"


def test_grpc_chat_roles_the_template_cannot_take_are_invalid_argument(client):
    for role in ("wizard", ""):
        with pytest.raises(grpc.RpcError) as err:
            client.complete(messages=[{"role": role, "content": "hi"}], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must be one of system, developer, user, assistant, tool" in err.value.details()
