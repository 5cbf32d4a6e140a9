"""The structured-output fields of an OpenAI body as the core's ``Guide``
(engine/structured.py; docs/serving.md, "Structured outputs"):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no guide), ``{"type":
  "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}`` (the schema; ``strict`` is taken either way: the
  output always matches the schema);
- vLLM's ``structured_outputs``: an object with exactly one of ``json`` (a schema, as an
  object or its JSON text), ``regex``, ``choice`` (a list of strings) or ``grammar`` (a
  Lark grammar).

At most one of the two asks for a guide. Shapes and types are checked here; whether a
spec compiles is the core's check (router/validation.py), on the intake's threads.
"""

from __future__ import annotations

import json

from pdserve.engine.structured import Guide

ANY_OBJECT = '{"type": "object"}'
_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar")


class BadGuide(ValueError):
    """A structured-output field of the wrong shape; ``param``: the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def read_guide(body: dict) -> tuple[Guide | None, str]:
    """The body's guide (None: none asked) and the field that asked for it."""
    from_format = _response_format(body.get("response_format"))
    from_outputs = _structured_outputs(body.get("structured_outputs"))
    if from_format is not None and from_outputs is not None:
        raise BadGuide(
            "response_format and structured_outputs: give at most one of them",
            "structured_outputs",
        )
    if from_format is not None:
        return from_format, "response_format"
    return from_outputs, "structured_outputs"


def _response_format(value) -> Guide | None:
    field = "response_format"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and value.keys() == {"type"}:
        return None
    if kind == "json_object" and value.keys() == {"type"}:
        return Guide("json", ANY_OBJECT)
    if kind == "json_schema" and value.keys() == {"type", "json_schema"}:
        spec = value["json_schema"]
        where = f"{field}.json_schema"
        if not isinstance(spec, dict) or not spec.keys() <= _SCHEMA_KEYS:
            raise BadGuide(
                f"{where}: must be an object with name, schema, strict, description", where
            )
        if not isinstance(spec.get("name"), str):
            raise BadGuide(f"{where}.name: required, a string", f"{where}.name")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise BadGuide(f"{where}.strict: must be true or false", f"{where}.strict")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise BadGuide(f"{where}.description: must be a string", f"{where}.description")
        schema = spec.get("schema")
        if schema is None:
            return Guide("json", ANY_OBJECT)
        if not isinstance(schema, dict):
            raise BadGuide(f"{where}.schema: must be a JSON schema object", f"{where}.schema")
        return Guide("json", json.dumps(schema))
    raise BadGuide(
        f'{field}: must be {{"type": "text"}}, {{"type": "json_object"}} or '
        '{"type": "json_schema", "json_schema": {...}}',
        field,
    )


def _structured_outputs(value) -> Guide | None:
    field = "structured_outputs"
    if value is None:
        return None
    given = [k for k in _STRUCTURED_KEYS if isinstance(value, dict) and value.get(k) is not None]
    if not isinstance(value, dict) or not value.keys() <= set(_STRUCTURED_KEYS) or len(given) != 1:
        raise BadGuide(
            f"{field}: must be an object with exactly one of {', '.join(_STRUCTURED_KEYS)}", field
        )
    [key] = given
    spec, where = value[key], f"{field}.{key}"
    if key == "json":
        if isinstance(spec, dict):
            return Guide("json", json.dumps(spec))
        if isinstance(spec, str) and spec:
            return Guide("json", _utf8(spec, where))
        raise BadGuide(f"{where}: must be a JSON schema, as an object or its JSON text", where)
    if key == "choice":
        if (
            not isinstance(spec, list)
            or not spec
            or not all(isinstance(c, str) and c for c in spec)
        ):
            raise BadGuide(f"{where}: must be a non-empty list of non-empty strings", where)
        return Guide("choice", json.dumps(spec))
    if not isinstance(spec, str) or not spec:
        raise BadGuide(f"{where}: must be a non-empty string", where)
    return Guide(key, _utf8(spec, where))


def _utf8(spec: str, where: str) -> str:
    """``spec`` when it is text: JSON's escapes can spell lone surrogates."""
    try:
        spec.encode("utf-8")
    except UnicodeEncodeError:
        raise BadGuide(f"{where}: holds a lone surrogate, not text", where) from None
    return spec
