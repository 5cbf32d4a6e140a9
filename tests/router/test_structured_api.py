"""Structured outputs through the HTTP API of this folder's co-located cluster (a tiny
random model: what its output says is noise, that it matches is not): the official
``openai`` client's ``chat.completions.parse`` returns the Pydantic object; vLLM's
``structured_outputs`` (regex, choice, grammar, json) hold, streamed and not, on both
endpoints (json_object, which a random model never closes, on the embedded model:
tests/cluster/test_structured_outputs.py); a spec that cannot compile, two guides, a wrong
shape or a spec past ``router.max_grammar_bytes`` is a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, conlist

from pdserve.cluster.config import RouterConfig

IDS = [5, 9, 33, 81]


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no keys of the model's own invention
    label: str = Field(max_length=6)
    count: int = Field(ge=0, le=999)
    kind: Literal["a", "b", "c"]
    flags: conlist(bool, max_length=3)


def ask(**kw) -> dict:
    return {
        "messages": [{"role": "user", "content": "Give an item."}],
        "max_tokens": 120,
        "temperature": 0,
        **kw,
    }


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_the_pydantic_object(api, chat_model, temperature):
    done = api.chat.completions.parse(
        model=chat_model, response_format=Item, **{**ask(), "temperature": temperature, "seed": 4}
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Item)
    assert Item.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        ({"regex": "[a-z]{6}-[0-9]{3}"}, lambda t: re.fullmatch("[a-z]{6}-[0-9]{3}", t)),
        ({"choice": ["north", "south", "east"]}, lambda t: t in ("north", "south", "east")),
        (
            {"grammar": 'start: "<" WORD ">"\nWORD: /[a-z]{2,5}/'},
            lambda t: re.fullmatch("<[a-z]{2,5}>", t),
        ),
        ({"json": Item.model_json_schema()}, Item.model_validate_json),
        ({"json": json.dumps(Item.model_json_schema())}, Item.model_validate_json),
    ],
)
def test_vllm_structured_outputs_on_both_endpoints(api, chat_model, spec, check):
    extra = {"structured_outputs": spec}
    chat = api.chat.completions.create(model=chat_model, extra_body=extra, **ask())
    assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)
    done = api.completions.create(
        model=chat_model, prompt=IDS, max_tokens=120, temperature=0, extra_body=extra
    )
    assert done.choices[0].finish_reason == "stop" and check(done.choices[0].text)
    chunks = api.completions.create(
        model=chat_model, prompt=IDS, max_tokens=120, temperature=0, extra_body=extra, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text


SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
}


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": SCHEMA_FORMAT}, None, "response_format: json: .*nonsense"),
        ({"structured_outputs": {"regex": "(open"}}, None, "structured_outputs: regex: "),
        (
            {"structured_outputs": {"grammar": "start: nowhere"}},
            None,
            "structured_outputs: grammar: ",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "structured_outputs: must be an object with exactly one of json, regex, choice",
        ),
        (
            {"structured_outputs": {"choice": ["a", 1]}},
            "structured_outputs.choice",
            "must be a non-empty list of non-empty strings",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "give at most one of them",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format: must be"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "name: required",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
            "must be a JSON schema object",
        ),
        (
            {"structured_outputs": {"regex": "a" * (RouterConfig().max_grammar_bytes + 1)}},
            None,
            f"structured_outputs: {RouterConfig().max_grammar_bytes + 1} bytes of regex spec, past "
            f"router.max_grammar_bytes={RouterConfig().max_grammar_bytes}",
        ),
    ],
)
def test_a_guide_that_cannot_run_is_a_400_naming_the_field(
    http, chat_model, fields, param, message
):
    for path, body in (("/v1/chat/completions", ask()), ("/v1/completions", {"prompt": IDS})):
        r = http.post(path, json={"model": chat_model, **body, **fields})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert re.search(message, error["message"]), error
        if param is not None:
            assert error["param"] == param


def test_a_guide_the_vocabulary_cannot_spell_is_a_400_not_a_server_error(http, chat_model):
    """Found by the fuzzer: the tiny byte tokenizer spells no 0x01, so the choice is a dead
    end once "a" is out; the request is refused as invalid (a retry would end the same),
    co-located here (disaggregated: tests/cluster/test_structured_outputs.py)."""
    fields = {"structured_outputs": {"choice": ["a\u0001b"]}}
    for path, body in (("/v1/chat/completions", ask()), ("/v1/completions", {"prompt": IDS})):
        r = http.post(path, json={"model": chat_model, **body, **fields})
        assert r.status_code == 400, r.text
        assert "the choice guide: after 1 output tokens no token" in r.json()["error"]["message"]
