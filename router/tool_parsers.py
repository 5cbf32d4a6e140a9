"""How a model family writes tool calls (docs/serving.md, "Tool calling"): a
``ToolParser``, chosen by the markers of the model's chat template (``for_template``).

Contract of a parser:
- ``grammar(tools, forced, parallel)``: a Lark grammar (llguidance's dialect, each call's
  JSON an inline ``%json`` schema) whose documents are calls in this format, of ``forced``
  only when given, one call unless ``parallel`` (then at most one per tool): what
  ``tool_choice: required`` and a named choice enforce through the request's guide;
- ``parse(text)``: the text outside calls and the well-formed calls in it, in order; a
  text with none is its own content;
- ``start``: the marker a call's text begins with; text before it is content, and a
  stream holds back what may be a marker's beginning (router/openai_tools.py);
- for a chat template that does not take ``tools``: ``system_text(tools)`` (the tools as
  the format's system prompt), ``call_text(calls)`` (an assistant's earlier calls as the
  model writes them) and ``result_text(content)`` (a tool's result, as a user turn).

Formats: ``hermes`` (Hermes / Qwen: ``<tool_call>{"name", "arguments"}</tool_call>``;
ChatML templates, the embedded SmolLM2's included), ``llama3`` (Llama 3.1+'s JSON
``{"name", "parameters"}``, calls joined by ``; ``) and ``mistral`` (``[TOOL_CALLS]`` and a
JSON array of ``{"name", "arguments"}``).
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod

from pdserve.engine.structured import JSON_LAYOUT
from pdserve.router.request import ChatMessage, Tool, ToolCall


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolParser(ABC):
    name: str = ""
    start: str = ""
    args_key = "arguments"  # the key of a call's arguments in its JSON

    @abstractmethod
    def grammar(self, tools: list[Tool], forced: str | None, parallel: bool) -> str: ...

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ToolCall]]: ...

    def call_schema(self, tools: list[Tool], forced: str | None) -> dict:
        """The JSON schema of one call of ``tools`` (of ``forced`` alone when given),
        laid out as ``json.dumps`` writes (engine/structured.py's ``JSON_LAYOUT``)."""
        defs: dict = {}
        one_of = []
        for k, t in enumerate(tools):
            if forced is not None and t.name != forced:
                continue
            defs.update(_hoisted(t.parameters, f"tool{k}"))
            arguments = {"$ref": f"#/$defs/tool{k}"}
            one_of.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, self.args_key: arguments},
                    "required": ["name", self.args_key],
                    "additionalProperties": False,
                }
            )
        return {"anyOf": one_of, "$defs": defs, "x-guidance": JSON_LAYOUT}

    def call_json(self, call: ToolCall) -> str:
        """One call's JSON as this format writes it."""
        return f'{{"name": {json.dumps(call.name)}, "{self.args_key}": {call.arguments}}}'

    def calls_of(self, objects: list) -> list[ToolCall] | None:
        """The calls of decoded JSON objects, or None when one is not a call."""
        calls = []
        for o in objects:
            if not (isinstance(o, dict) and isinstance(o.get("name"), str)):
                return None
            args = o.get(self.args_key, {})
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(call_id(), o["name"], json.dumps(args)))
        return calls

    def system_text(self, tools: list[Tool]) -> str:
        listed = "\n".join(json.dumps(t.as_openai()) for t in tools)
        return (
            "You may call one or more functions to answer. The functions, as JSON "
            f"signatures:\n{listed}\n{self.example()}"
        )

    @abstractmethod
    def example(self) -> str:
        """How a call is written, for ``system_text``."""

    @abstractmethod
    def call_text(self, calls: list[ToolCall]) -> str: ...

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def template_inputs(
        self, messages: list[ChatMessage], tools: list[Tool], takes_tools: bool
    ) -> tuple[list[dict], list[dict] | None]:
        """A chat's messages and tools as its template takes them: HF's convention
        (``tool_calls`` with object arguments, ``tool`` messages, ``tools``) when the
        template reads tools; otherwise in this format's words: the tools in the system
        message, earlier calls in the assistant's text, results as user turns."""
        if takes_tools:
            out = []
            for m in messages:
                d: dict = {"role": m.role, "content": m.content}
                if m.tool_calls:
                    d["tool_calls"] = [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                        for c in m.tool_calls
                    ]  # fmt: skip
                if m.role == "tool":
                    d["tool_call_id"] = m.tool_call_id
                out.append(d)
            return out, [t.as_openai() for t in tools] or None
        out = []
        for m in messages:
            if m.role == "tool":
                out.append({"role": "user", "content": self.result_text(m.content)})
                continue
            text = m.content
            if m.tool_calls:
                text = "\n".join(filter(None, [text, self.call_text(m.tool_calls)]))
            out.append({"role": m.role, "content": text})
        if tools:
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{self.system_text(tools)}"}
            else:
                out.insert(0, {"role": "system", "content": self.system_text(tools)})
        return out, None


class Hermes(ToolParser):
    name, start = "hermes", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def grammar(self, tools: list[Tool], forced: str | None, parallel: bool) -> str:
        more = _more('"\\n"', tools, forced, parallel)
        body = json.dumps(self.call_schema(tools, forced))
        return (
            f'start: call {more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {body}'
        )

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls, content, at = [], [], 0
        for m in self._CALL.finditer(text):
            try:
                found = self.calls_of([json.loads(m.group(1))])
            except ValueError:
                found = None
            if found is None:
                continue
            content.append(text[at : m.start()])
            calls += found
            at = m.end()
        content.append(text[at:])
        return "".join(content).strip() if calls else text, calls

    def example(self) -> str:
        return (
            'For each call, write <tool_call>\n{"name": <function name>, "arguments": '
            "<arguments object>}\n</tool_call>"
        )

    def call_text(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"<tool_call>\n{self.call_json(c)}\n</tool_call>" for c in calls)


class Llama3Json(ToolParser):
    name, start, args_key = "llama3", "{", "parameters"

    def grammar(self, tools: list[Tool], forced: str | None, parallel: bool) -> str:
        more = _more('"; "', tools, forced, parallel)
        return f"start: call {more}\ncall: %json {json.dumps(self.call_schema(tools, forced))}"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        objects, decoder, at = [], json.JSONDecoder(), 0
        try:
            while at < len(body):
                obj, at = decoder.raw_decode(body, at)
                objects.append(obj)
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except ValueError:
            return text, []
        calls = self.calls_of(objects) if objects else None
        return ("", calls) if calls else (text, [])

    def example(self) -> str:
        return 'For a call, write {"name": <function name>, "parameters": <arguments object>}'

    def call_text(self, calls: list[ToolCall]) -> str:
        return "; ".join(self.call_json(c) for c in calls)


class Mistral(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"

    def grammar(self, tools: list[Tool], forced: str | None, parallel: bool) -> str:
        most = len(tools) if parallel and forced is None else 1
        call = self.call_schema(tools, forced)
        defs, layout = call.pop("$defs"), call.pop("x-guidance")  # at the document's root
        schema = {"type": "array", "items": call, "minItems": 1, "maxItems": most,
                  "$defs": defs, "x-guidance": layout}  # fmt: skip
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json {json.dumps(schema)}'

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        before, marker, after = text.partition(self.start)
        if not marker:
            return text, []
        try:
            objects, _ = json.JSONDecoder().raw_decode(after.strip())
        except ValueError:
            return text, []
        calls = self.calls_of(objects) if isinstance(objects, list) and objects else None
        return (before.strip(), calls) if calls else (text, [])

    def example(self) -> str:
        return 'For calls, write [TOOL_CALLS][{"name": <function name>, "arguments": <object>}]'

    def call_text(self, calls: list[ToolCall]) -> str:
        items = ", ".join(self.call_json(c) for c in calls)
        return f"[TOOL_CALLS][{items}]"


def _hoisted(schema: dict, name: str) -> dict:
    """``schema`` and its definitions as top-level ``$defs`` of a schema that holds
    several: itself under ``name``, each of its ``$defs`` (or ``definitions``) under
    ``name.key``, every ``$ref`` into them rewritten (``#`` is ``name`` itself)."""
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}

    def moved(node):
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: moved(v) for k, v in node.items() if k not in ("$defs", "definitions")}
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref == "#":
                out["$ref"] = f"#/$defs/{name}"
            for prefix in ("#/$defs/", "#/definitions/"):
                if ref.startswith(prefix):
                    out["$ref"] = f"#/$defs/{name}.{ref[len(prefix) :]}"
        return out

    return {name: moved(schema), **{f"{name}.{k}": moved(v) for k, v in local.items()}}


def _more(separator: str, tools: list[Tool], forced: str | None, parallel: bool) -> str:
    """The grammar's further calls after the first: up to one per other tool."""
    if not parallel or forced is not None or len(tools) < 2:
        return ""
    return f"({separator} call){{0,{len(tools) - 1}}}"


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Hermes, Llama3Json, Mistral)}


def for_template(template: str | None) -> ToolParser:
    """The format a chat template's family writes calls in: Mistral's where it speaks
    ``[INST]``, Llama 3's where it has header ids, else Hermes' (ChatML and the rest)."""
    text = template or ""
    if "[TOOL_CALLS]" in text or "[INST]" in text:
        return Mistral()
    if "<|start_header_id|>" in text:
        return Llama3Json()
    return Hermes()
