"""Tool calling over the OpenAI chat API (docs/serving.md, "Tool calling"): the body's
``tools``, ``tool_choice`` and ``parallel_tool_calls`` and a message's ``tool_calls`` as
core types (``read_tools``, ``message_calls``), and the calls of a reply, parsed from
its whole text or from its stream as it arrives (``ToolStream``), in OpenAI's shapes.

Shapes and types are checked here; whether the tools' schemas compile and a named choice
is among them is the core's check (router/validation.py).
"""

from __future__ import annotations

import json

from pdserve.router.request import Tool, ToolCall
from pdserve.router.tool_parsers import ToolParser

CHOICES = ("none", "auto", "required")


class BadTools(ValueError):
    """A tool-calling field of the wrong shape; ``param``: the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def read_tools(body: dict) -> tuple[list[Tool], str, bool]:
    """(tools, tool_choice, parallel_tool_calls) of a chat body; tool_choice is "none",
    "auto", "required" or the forced function's name (default: "auto" with tools,
    "none" without)."""
    raw = body.get("tools")
    tools = [] if raw is None else _tools(raw)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not (choice.keys() == {"type", "function"} and isinstance(fn, dict)
                and fn.keys() == {"name"} and isinstance(fn["name"], str)):  # fmt: skip
            raise BadTools(
                'tool_choice: must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        choice = fn["name"]
        if choice in CHOICES:  # a function so named is forced, not the mode
            raise BadTools(f"tool_choice.function.name={choice!r}: a reserved word", "tool_choice")
    elif choice not in CHOICES:
        raise BadTools(f"tool_choice={str(choice)[:40]!r}: must be one of {CHOICES}", "tool_choice")
    if choice != "none" and not tools:
        raise BadTools(f"tool_choice={choice!r}: no tools given", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadTools("parallel_tool_calls: must be true or false", "parallel_tool_calls")
    return tools, choice, True if parallel is None else parallel


def _tools(raw) -> list[Tool]:
    if not isinstance(raw, list):
        raise BadTools("tools: must be a list of functions", "tools")
    tools, names = [], set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not (isinstance(fn, dict) and t.keys() == {"type", "function"}):
            raise BadTools(f'{where}: must be {{"type": "function", "function": {{...}}}}', where)
        if not fn.keys() <= {"name", "description", "parameters", "strict"}:
            raise BadTools(f"{where}.function: unknown keys {sorted(fn.keys())}", where)
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name or len(name) > 64 or name in names:
            raise BadTools(f"{where}.function.name: a unique string of 1-64 characters", where)
        if not isinstance(params, dict):
            raise BadTools(f"{where}.function.parameters: must be a JSON schema object", where)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise BadTools(f"{where}.function.description: must be a string", where)
        names.add(name)
        tools.append(Tool(name, description, params))
    return tools


def message_calls(where: str, value) -> list[ToolCall]:
    """An assistant message's ``tool_calls`` (OpenAI's shape; None: none)."""
    if value is None:
        return []
    calls = []
    for j, c in enumerate(value if isinstance(value, list) else [None]):
        call = _call(c)
        if call is None:
            raise BadTools(
                f"{where}.tool_calls[{j}]: must be {{id, type: function, function: {{name, "
                "arguments: a JSON object's text}}}",
                f"{where}.tool_calls",
            )
        calls.append(call)
    return calls


def _call(c) -> ToolCall | None:
    """One of a message's ``tool_calls`` in OpenAI's shape, or None."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not (isinstance(c, dict) and isinstance(fn, dict) and isinstance(c.get("id"), str)):
        return None
    name, arguments = fn.get("name"), fn.get("arguments")
    if c.get("type", "function") != "function" or not isinstance(name, str):
        return None
    try:
        if not isinstance(arguments, str) or not isinstance(json.loads(arguments), dict):
            return None
    except ValueError:
        return None
    return ToolCall(c["id"], name, arguments)


def calls_json(calls: list[ToolCall], indexed: bool = False) -> list[dict]:
    """OpenAI's ``tool_calls`` objects (``indexed``: a stream delta's, with ``index``)."""
    out = []
    for i, c in enumerate(calls):
        call = {"id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}}  # fmt: skip
        out.append({"index": i, **call} if indexed else call)
    return out


class ToolStream:
    """A streamed reply's text split into content, sent as it comes, and calls, sent at
    the end: text from the parser's ``start`` marker on is held (a marker's beginning at
    the end of what came so far too, until the next text shows whether it is one)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._pending = ""  # content that may be the start of a marker
        self._held: str | None = None  # from the marker on, once one came

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        if self._held is not None:
            self._held += text
            return ""
        text, start = self._pending + text, self.parser.start
        at = text.find(start)
        if at >= 0:
            self._held, self._pending = text[at:], ""
            return text[:at]
        keep = next((k for k in range(min(len(start) - 1, len(text)), 0, -1)
                     if start.startswith(text[-k:])), 0)  # fmt: skip
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content left and the calls, once the reply ended."""
        if self._held is None:
            return self._pending, []
        content, calls = self.parser.parse(self._held)
        return self._pending + content, calls
