"""Tool calling through the HTTP API of this folder's co-located cluster, with the official
``openai`` client: ``tool_choice`` required and named give calls whose arguments validate
against the tool's schema, streamed (content as it comes, the calls with the last chunk)
and not, with ``finish_reason: tool_calls``; a conversation with earlier calls and tool
results goes through the template; malformed tools, an unknown named function, a schema
that does not compile or two guides are 400s naming the field. (The embedded model, 50
tools of varied schemas, co-located and disaggregated: tests/cluster/test_structured_outputs.py.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


def streamed(api, **kw) -> tuple[str, list, str]:
    content, calls, finish = "", [], None
    for chunk in api.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
@pytest.mark.parametrize("parallel", [True, False])
def test_required_and_named_calls_validate_streamed_and_not(api, chat_model, choice, parallel):
    kw = dict(model=chat_model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
              parallel_tool_calls=parallel, temperature=0, max_tokens=300)  # fmt: skip
    whole = api.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls, whole
    for call in whole.message.tool_calls:
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, calls, finish = streamed(api, **kw)
    assert finish == "tool_calls" and content == ""
    got = [(c.function.name, c.function.arguments) for c in calls]
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [c.index for c in calls] == list(range(len(calls)))


def test_a_conversation_with_calls_and_results_goes_through_the_template(api, chat_model):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C, rain"},
    ]  # fmt: skip
    done = api.chat.completions.create(model=chat_model, messages=history, tools=TOOLS,
                                       temperature=0, max_tokens=4)  # fmt: skip
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert done.usage.prompt_tokens > 0


BAD_WEATHER = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "nonsense"}}}


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0]", "tools[0]: must be"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
        ({"tool_choice": "required"}, "tool_choice", "no tools given"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         None, "tool_choice: function 'nope' is not in tools"),
        ({"tools": [BAD_WEATHER]}, None, "tools: a function's parameters do not compile"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         None, "both ask for the output's form"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1]", "a unique string"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}]},
         "messages[0].tool_calls", "tool_calls[0]: must be"),
    ],
)  # fmt: skip
def test_tools_that_cannot_run_are_a_400_naming_the_field(http, chat_model, fields, param, message):
    body = {"model": chat_model, "messages": MESSAGES, "max_tokens": 4, **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param
