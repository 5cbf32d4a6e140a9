"""The tool-call formats (router/tool_parsers.py) and the stream splitter
(router/openai_tools.py): each format's grammar, run by the engine on the tiny model,
writes calls its own parser reads back, of the forced function when one is named, that
validate against the tool's schema; parsing hand-written replies; a stream's content
comes out as it arrives, its calls at the end, wherever the chunks cut the marker; a
template without tools gets them in the format's words."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.structured import Guide
from pdserve.router.openai_tools import ToolStream
from pdserve.router.request import ChatMessage, Tool, ToolCall
from pdserve.router.tool_parsers import PARSERS, Hermes, Llama3Json, Mistral, for_template

WEATHER = Tool(
    "get_weather",
    "weather of a city",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    },
)
TIME = Tool(
    "get_time",
    "local time",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["zone"],
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    },
)
TOOLS = [WEATHER, TIME]  # fmt: skip
SCHEMAS = {t.name: t.parameters for t in TOOLS}


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(chat_model)


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("forced", [None, "get_time"])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_grammar_writes_calls_the_parser_reads_back(llm, name, forced, parallel):
    parser = PARSERS[name]()
    guide = Guide("grammar", parser.grammar(TOOLS, forced, parallel))
    params = [
        SamplingParams(max_tokens=400, temperature=1.0, seed=s, guide=guide) for s in range(6)
    ]
    for out in llm.generate([[5, 6, 7]] * 6, params):
        assert out.finish_reason == "stop", out.text
        content, calls = parser.parse(out.text)
        assert calls and content == "", out.text
        assert len(calls) <= (len(TOOLS) if parallel and forced is None else 1)
        for call in calls:
            assert forced in (None, call.name) and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_replies_are_parsed_into_content_and_calls():
    hermes, llama, mistral = Hermes(), Llama3Json(), Mistral()
    text = 'Let me see.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'
    content, calls = hermes.parse(text)
    assert content == "Let me see." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": 2})
    ]
    assert hermes.parse("<tool_call>\nnot json\n</tool_call>") == (
        "<tool_call>\nnot json\n</tool_call>",
        [],
    )
    two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert [c.name for c in llama.parse(two)[1]] == ["a", "b"]
    assert llama.parse("The answer is {1}.") == ("The answer is {1}.", [])
    content, calls = mistral.parse('ok [TOOL_CALLS][{"name": "a", "arguments": {"k": "v"}}]')
    assert content == "ok" and calls[0].arguments == '{"k": "v"}'
    assert mistral.parse("[TOOL_CALLS] nope") == ("[TOOL_CALLS] nope", [])


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 11])
def test_a_stream_sends_content_as_it_comes_and_calls_at_the_end(cut):
    text = (
        'Checking <b>.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    )
    stream = ToolStream(Hermes())
    sent = "".join(stream.feed(text[i : i + cut]) for i in range(0, len(text), cut))
    rest, calls = stream.finish()
    assert (sent + rest).strip() == "Checking <b>." and [c.name for c in calls] == ["get_time"]
    assert "<tool" not in sent  # the marker's beginning was held, never sent
    plain = ToolStream(Hermes())
    sent = "".join(plain.feed(c) for c in "a < b <tool")
    assert sent + plain.finish()[0] == "a < b <tool"


def test_a_template_without_tools_gets_them_in_the_formats_words():
    parser = Hermes()
    call = ToolCall("call_1", "get_time", '{"zone": 3}')
    chat = [
        ChatMessage("user", "time?"),
        ChatMessage("assistant", "", [call]),
        ChatMessage("tool", "12:00", tool_call_id="call_1"),
    ]
    messages, tools = parser.template_inputs(chat, TOOLS, takes_tools=False)
    assert tools is None and [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "user",
    ]
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == parser.call_text([call])
    assert messages[3]["content"] == "<tool_response>\n12:00\n</tool_response>"
    messages, tools = parser.template_inputs(chat, TOOLS, takes_tools=True)
    assert tools == [t.as_openai() for t in TOOLS]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"zone": 3}
    assert messages[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}


def test_the_format_follows_the_chat_template():
    assert isinstance(for_template("{{'<|im_start|>' + m['role']}}"), Hermes)
    assert isinstance(for_template("<|start_header_id|>{{ role }}"), Llama3Json)
    assert isinstance(for_template("[INST] {{ content }} [/INST]"), Mistral)
    assert isinstance(for_template(None), Hermes)


def test_tools_with_definitions_of_the_same_name_each_keep_theirs(llm):
    """Pydantic's schemas refer to ``#/$defs/...`` of their own root: two tools with a
    ``P`` of their own compile side by side, each call valid against its own."""

    def tool(name: str, inner: dict) -> Tool:
        schema = {"type": "object", "required": ["p"], "additionalProperties": False,
                  "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": inner}}  # fmt: skip
        return Tool(name, "", schema)

    tools = [
        tool("a", {"enum": ["x", "y"]}),
        tool("b", {"type": "integer", "minimum": 0, "maximum": 9}),
    ]
    for parser in (Hermes(), Llama3Json(), Mistral()):
        guide = Guide("grammar", parser.grammar(tools, None, False))
        params = [
            SamplingParams(max_tokens=200, temperature=1.0, seed=s, guide=guide) for s in range(8)
        ]
        for out in llm.generate([[9, 8, 7]] * 8, params):
            [call] = parser.parse(out.text)[1]
            jsonschema.validate(
                json.loads(call.arguments), {t.name: t.parameters for t in tools}[call.name]
            )
