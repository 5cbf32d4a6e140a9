"""docs/openapi.yaml without a server: a valid OpenAPI 3.1 document (schemathesis loads
and validates it, every schema is valid JSON Schema 2020-12) that lists exactly the
request fields router/openai_fields.py names, every field router/openai_request.py
reads among them, and that accepts exactly what the reader accepts of the fields
pdserve does not implement."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import schemathesis
import yaml

from pdserve.router import openai_fields as f
from pdserve.router.openai_request import BadRequest, read_request

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "openapi.yaml"
PROBES = [None, 0, 1, 2, -1, 0.5, True, False, "", "x", "none", "text", [], ["text"], [1],
          {}, {"type": "text"}, {"type": "json_object"}, {"a": "b"}]  # fmt: skip


@pytest.fixture(scope="module")
def spec() -> dict:
    return yaml.safe_load(SPEC.read_text())


def schema_of(spec: dict, name: str) -> dict:
    return spec["components"]["schemas"][name]


def validator(spec: dict, schema: dict) -> jsonschema.Draft202012Validator:
    """``schema`` with the document's components reachable for ``$ref``."""
    return jsonschema.Draft202012Validator({**schema, "components": spec["components"]})


def test_the_document_is_valid_openapi_with_the_served_operations(spec):
    loaded = schemathesis.openapi.from_path(SPEC)
    loaded.validate()  # against the OpenAPI 3.1 meta-schema
    labels = {op.ok().label for op in loaded.get_all_operations()}
    assert labels == {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                      "GET /health", "GET /metrics", "GET /metrics/targets",
                      "GET /v1/requests/{request_id}/stream"}  # fmt: skip
    for schema in spec["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("chat", [False, True])
def test_each_request_schema_lists_exactly_the_fields_the_router_knows(spec, chat):
    read, metadata, fixed = f.fields(chat)
    schema = schema_of(spec, "ChatCompletionRequest" if chat else "CompletionRequest")
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(read) | set(metadata) | set(fixed)
    message = schema_of(spec, "ChatMessage")
    assert set(message["properties"]) == set(f.MESSAGE_READ) | set(f.MESSAGE_FIXED)


def test_every_field_the_reader_reads_is_in_its_tables():
    source = (ROOT / "router" / "openai_request.py").read_text()
    keys = set(re.findall(r'(?:body\.get\(|_number\(body, |_flag\(body, )"(\w+)"', source))
    assert {"prompt", "messages", "max_tokens", "temperature", "echo", "timeout"} <= keys
    assert keys <= f.COMPLETIONS_READ | f.CHAT_READ


@pytest.mark.parametrize("chat", [False, True])
def test_unimplemented_fields_accept_in_the_spec_what_the_reader_accepts(spec, chat):
    _, metadata, fixed = f.fields(chat)
    schema = schema_of(spec, "ChatCompletionRequest" if chat else "CompletionRequest")
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    for key in sorted(fixed):
        check = validator(spec, schema["properties"][key])
        for value in PROBES:
            try:
                read_request({**base, key: value}, chat)
                served = True
            except BadRequest as e:
                assert e.param == key and e.message.startswith(f"{key}="), e.message
                served = False
            assert check.is_valid(value) == served, (key, value)
    for key, kind in metadata.items():
        check = validator(spec, schema["properties"][key])
        assert check.is_valid("id") == (kind is str) and check.is_valid(None)
