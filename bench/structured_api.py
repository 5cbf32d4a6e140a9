"""The agent-facing API on the embedded model, counted: with the official ``openai``
client against a co-located and a disaggregated cluster, how many of ``--n`` requests
of each kind come back valid:

- ``parse``: ``chat.completions.parse`` with a Pydantic model (``models``: nested
  objects, enums, arrays, optional fields, numbers, booleans, literals), greedy;
- ``json_object``: ``response_format: json_object`` on prompts that ask for a small
  object (temperature 0.7, seeded): the output ends as one JSON object, or runs into
  ``max_tokens`` (the 135M model repeats itself inside a string now and then);
- ``required`` and ``named``: ``tool_choice`` over two tools of those schemas
  (``openai.pydantic_function_tool``), half of the requests streamed: one call, of the
  named tool for ``named``, whose arguments validate against its tool's schema.

    .venv/bin/python -m pdserve.bench.structured_api [--n 50] [--modes colocated,disaggregated]

Every kind's requests go out at once (batched with each other). tests/cluster/
test_structured_outputs.py runs the same with a smaller ``n``.
"""

from __future__ import annotations

import argparse
import enum
import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import openai
from pydantic import BaseModel, Field, conint, conlist, constr, create_model

EMBEDDED = "smollm2-135m"
MAX_TOKENS = 300
KINDS = ("parse", "json_object", "required", "named")


class Color(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip_code: int = Field(ge=0, le=99999)


class Pet(BaseModel):
    name: str = Field(max_length=16)
    kind: Literal["cat", "dog", "bird"]


# strings, arrays and numbers bounded, as a schema for a small model should be: unbounded,
# a 135M model's greedy output may repeat until max_tokens
_FIELDS = [
    ("name", (str, Field(max_length=24))),
    ("age", (int, Field(ge=0, le=150))),
    ("height_m", (float, Field(ge=0, le=3))),
    ("active", (bool, ...)),
    ("color", (Color, ...)),
    ("address", (Address, ...)),
    ("tags", (conlist(constr(max_length=16), max_length=3), ...)),
    ("scores", (conlist(conint(ge=0, le=100), min_length=1, max_length=4), ...)),
    ("pet", (Pet | None, None)),
    ("nickname", (str | None, Field(default=None, max_length=16))),
    ("pets", (conlist(Pet, max_length=2), ...)),
    ("level", (Literal["low", "mid", "high"], ...)),
]
PROMPTS = [
    "Describe a fictional person.",
    "Make up a record for a customer.",
    "Invent a character for a story.",
    "Give an example entry for a database.",
]
THINGS = ("a cat", "Paris", "the number 7", "a red car", "water", "the moon", "a book",
          "an apple", "a river", "a teacher")  # fmt: skip
KEYS = ("'name', 'color'", "'city', 'country'", "'size', 'weight'", "'title'", "'answer'")
JSON_ASKS = [
    f"Write a JSON object about {thing} with only the keys {keys}; each value one word."
    for keys in KEYS
    for thing in THINGS
]


def models(n: int = 50, seed: int = 7) -> list[type[BaseModel]]:
    """``n`` models of 1-5 fields each, drawn from ``_FIELDS``, the same every run."""
    rng = random.Random(seed)
    return [
        create_model(f"Thing{i}", **dict(rng.sample(_FIELDS, rng.randint(1, 5)))) for i in range(n)
    ]


def run(api: openai.OpenAI, n: int) -> dict[str, list]:
    """Per kind, one entry per request: None when it came back valid, else what was
    wrong (json_object: "length" for an output cut by max_tokens)."""
    schemas = models(n)

    def parse(i: int):
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        done = api.chat.completions.parse(
            model=EMBEDDED,
            messages=messages,
            temperature=0,
            max_tokens=MAX_TOKENS,
            response_format=schemas[i],
        )
        parsed = done.choices[0].message.parsed
        return None if isinstance(parsed, schemas[i]) else repr(done.choices[0])

    def json_object(i: int):
        messages = [{"role": "user", "content": JSON_ASKS[i % len(JSON_ASKS)]}]
        done = api.chat.completions.create(model=EMBEDDED, messages=messages, temperature=0.7,
                                           seed=i, max_tokens=MAX_TOKENS,
                                           response_format={"type": "json_object"})  # fmt: skip
        end, text = done.choices[0].finish_reason, done.choices[0].message.content
        if end == "length":
            return "length"
        return None if end == "stop" and isinstance(json.loads(text), dict) else repr(text)

    def tool_call(i: int, named: bool):
        tools = [openai.pydantic_function_tool(schemas[i], name=f"record_{i}"),
                 openai.pydantic_function_tool(schemas[i - 1], name=f"other_{i}")]  # fmt: skip
        choice = {"type": "function", "function": {"name": f"record_{i}"}} if named else "required"
        messages = [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} Record it."}]
        kw = dict(model=EMBEDDED, messages=messages, tools=tools, tool_choice=choice,
                  parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)  # fmt: skip
        if i % 2:  # streamed: the calls come whole with the last chunk
            calls, finish = [], None
            for chunk in api.chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    calls += chunk.choices[0].delta.tool_calls or []
                    finish = chunk.choices[0].finish_reason or finish
        else:
            done = api.chat.completions.create(**kw).choices[0]
            calls, finish = done.message.tool_calls or [], done.finish_reason
        got = [(c.function.name, c.function.arguments) for c in calls]
        if finish != "tool_calls" or len(got) != 1:
            return f"{finish}: {got}"
        [(name, arguments)] = got
        if name not in (f"record_{i}", *(() if named else (f"other_{i}",))):
            return f"called {name}"
        schemas[i if name == f"record_{i}" else i - 1].model_validate_json(arguments)
        return None

    with ThreadPoolExecutor(n) as pool:
        return {
            "parse": list(pool.map(parse, range(n))),
            "json_object": list(pool.map(json_object, range(n))),
            "required": list(pool.map(lambda i: tool_call(i, False), range(n))),
            "named": list(pool.map(lambda i: tool_call(i, True), range(n))),
        }


def config(mode: str) -> dict:
    """One instance of each role (or one co-located) of the embedded model, on loopback."""
    router = {"host": "127.0.0.1", "port": 0, "http_port": 0, "max_queue": 256}
    pool = {"max_batch_tokens": 256, "kv_blocks": 1024, "block_size": 16, "max_batch_size": 64}
    if mode == "colocated":
        colocated = {**pool, "instances": 1, "resources": {"num_cpus": 2}}
        return {"model": EMBEDDED, "mode": mode, "router": router, "colocated": colocated}
    return {
        "model": EMBEDDED,
        "mode": "disaggregated",
        "router": router,
        "prefill": {**pool, "instances": 1, "resources": {"num_cpus": 0.5}},
        "decode": {**pool, "instances": 1, "resources": {"num_cpus": 1}},
        "kv_transfer": {"backend": "gloo", "layerwise": True},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--modes", default="colocated,disaggregated")
    args = ap.parse_args()
    from pdserve.cluster import launch

    for mode in args.modes.split(","):
        with launch(config(mode)) as cluster:
            api = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="x")
            results = run(api, args.n)
        for kind in KINDS:
            wrong = [r for r in results[kind] if r is not None]
            cut = sum(r == "length" for r in wrong)
            note = f" ({cut} cut by max_tokens={MAX_TOKENS})" if cut else ""
            print(f"{mode:>13} {kind:>11}: {args.n - len(wrong)}/{args.n} valid{note}")
            for r in [r for r in wrong if r != "length"][:3]:
                print(f"{'':>27}{r[:160]}")


if __name__ == "__main__":
    main()
