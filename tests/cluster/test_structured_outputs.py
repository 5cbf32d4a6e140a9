"""Structured outputs through real clusters with the official ``openai`` client:

- on the embedded model, co-located and disaggregated: ``chat.completions.parse``
  returns the Pydantic object for 50 of 50 varied schemas; every ``json_object`` output
  that ends (40 of 50 at least) is one JSON object; ``tool_choice`` required and named
  each give one call whose arguments validate against its tool's schema, 50 of 50
  (half of them streamed); all sent 50 at once (batched with each other);
- greedy guided output is the offline engine's, token for token, co-located and
  disaggregated over gloo (TP 1) and gRPC (decode TP 2): the decode instance's matcher,
  rebuilt from the first token the prefill instance sampled under the grammar, goes on
  where it stood; a guide the vocabulary cannot spell is refused as INVALID once its
  output reaches the dead end, wherever that is;
- a guided stream whose decode instance is SIGKILLed mid-stream is migrated, and ends
  exactly as the uninterrupted run (the new decode instance replays the delivered tokens
  into its matcher; no grammar restart)."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.structured import Guide
from tests.cluster.helpers import seconds_until_blocks_free, small_cluster_config, wait_until
from tests.cluster.test_disagg import disagg_config
from tests.cluster.test_supervision import SUPERVISOR, back_in_service, busiest
from tests.structured.schemas import PROMPTS, models

EMBEDDED = "smollm2-135m"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"enum": ["s", "m", "l"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "ok"],
    "additionalProperties": False,
}
SPECS = [  # (vLLM structured_outputs, the same as a Guide)
    ({"regex": "[a-z]{40}"}, Guide("regex", "[a-z]{40}")),
    ({"json": SCHEMA}, Guide("json", json.dumps(SCHEMA))),
    ({"choice": ["left", "right"]}, Guide("choice", json.dumps(["left", "right"]))),
    (
        {"grammar": 'start: "[" D "," D "]"\nD: /[0-9]{3}/'},
        Guide("grammar", 'start: "[" D "," D "]"\nD: /[0-9]{3}/'),
    ),
]
PROMPT = [7, 19, 33, 60, 2, 91]
JSON_ASKS = [
    f"Write a JSON object about {thing} with only the keys {keys}; each value one word."
    for keys in ("'name', 'color'", "'city', 'country'", "'size', 'weight'", "'title'", "'answer'")
    for thing in (
        "a cat",
        "Paris",
        "the number 7",
        "a red car",
        "water",
        "the moon",
        "a book",
        "an apple",
        "a river",
        "a teacher",
    )
]


def embedded_config(mode: str) -> dict:
    if mode == "colocated":
        config = small_cluster_config(EMBEDDED, max_queue=128)
        config["colocated"].update(instances=1, max_batch_size=32, resources={"num_cpus": 2})
        return config
    config = disagg_config(EMBEDDED, "gloo", True, 1)
    config["router"]["max_queue"] = 128
    config["decode"].update(kv_blocks=1024, resources={"num_cpus": 1})
    return config


def openai_client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_parse_json_object_and_tool_calls_hold_on_the_embedded_model(mode, on_shared_ray):
    from pdserve.cluster import launch

    schemas = models(50)
    with launch(embedded_config(mode)) as cluster, openai_client(cluster) as api:

        def parse(i: int):
            messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
            done = api.chat.completions.parse(
                model=EMBEDDED,
                messages=messages,
                temperature=0,
                max_tokens=300,
                response_format=schemas[i],
            )
            return done.choices[0].message.parsed

        def json_object(i: int):
            messages = [{"role": "user", "content": JSON_ASKS[i]}]
            done = api.chat.completions.create(
                model=EMBEDDED,
                messages=messages,
                max_tokens=300,
                temperature=0.7,
                seed=i,
                response_format={"type": "json_object"},
            )
            return done.choices[0].finish_reason, done.choices[0].message.content

        def tool_calls(case: tuple[int, bool, bool]) -> list[tuple[str, str]]:
            i, named, stream = case
            tools = [openai.pydantic_function_tool(schemas[i], name=f"record_{i}"),
                     openai.pydantic_function_tool(schemas[i - 1], name=f"other_{i}")]  # fmt: skip
            choice = (
                {"type": "function", "function": {"name": f"record_{i}"}} if named else "required"
            )
            messages = [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} Record it."}]
            kw = dict(model=EMBEDDED, messages=messages, tools=tools, tool_choice=choice,
                      parallel_tool_calls=False, temperature=0, max_tokens=300)  # fmt: skip
            if not stream:
                done = api.chat.completions.create(**kw).choices[0]
                assert done.finish_reason == "tool_calls", done
                return [(c.function.name, c.function.arguments) for c in done.message.tool_calls]
            calls, finish = [], None
            for chunk in api.chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    calls += chunk.choices[0].delta.tool_calls or []
                    finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls", calls
            return [(c.function.name, c.function.arguments) for c in calls]

        # 50 required and 50 named, half of each streamed
        cases = [(i, named, i % 2 == 1) for named in (False, True) for i in range(50)]
        with ThreadPoolExecutor(50) as pool:
            parsed = list(pool.map(parse, range(50)))
            objects = list(pool.map(json_object, range(50)))
            called = list(pool.map(tool_calls, cases))
    for (i, named, _), calls in zip(cases, called, strict=True):
        assert len(calls) == 1, calls
        [(name, arguments)] = calls
        assert name == f"record_{i}" or (not named and name == f"other_{i}"), calls
        schemas[i if name == f"record_{i}" else i - 1].model_validate_json(arguments)
    assert all(isinstance(p, schemas[i]) for i, p in enumerate(parsed)), parsed
    # every output that ended is one JSON object; the others ran into max_tokens (the
    # 135M model repeats itself inside a string now and then: its part, not the grammar's)
    ended = [json.loads(text) for end, text in objects if end == "stop"]
    assert all(isinstance(o, dict) for o in ended), objects
    assert all(end in ("stop", "length") for end, _ in objects), objects
    assert len(ended) >= 40, objects


@pytest.fixture(scope="module")
def offline(chat_model) -> list:
    llm = LLM(chat_model)
    params = [SamplingParams(max_tokens=64, temperature=0, guide=g) for _, g in SPECS]
    return llm.generate([PROMPT] * len(SPECS), params)


@pytest.mark.parametrize("shape", ["colocated", "gloo-tp1", "grpc-decode-tp2"])
def test_greedy_guided_output_is_the_offline_engines_everywhere(
    chat_model, offline, shape, on_shared_ray
):
    from pdserve.cluster import launch

    if shape == "colocated":
        config = small_cluster_config(chat_model)
    else:
        backend = shape.split("-")[0]
        config = disagg_config(chat_model, backend, backend == "gloo", 1)
        config["prefill"]["resources"] = {"num_cpus": 0.5}
        config["decode"].update(
            resources={"num_cpus": 0.5}, tensor_parallel=2 if shape.endswith("tp2") else 1
        )
    with launch(config) as cluster, openai_client(cluster) as api, cluster.client() as client:
        for (spec, _), want in zip(SPECS, offline, strict=True):
            done = client.complete(
                prompt_token_ids=PROMPT, max_tokens=64, temperature=0, structured_outputs=spec
            )
            assert (done.token_ids, done.finish_reason) == (want.token_ids, "stop"), (shape, spec)
            http = api.completions.create(
                model=chat_model,
                prompt=PROMPT,
                max_tokens=64,
                temperature=0,
                extra_body={"structured_outputs": spec},
            )
            assert http.choices[0].text == want.text, (shape, spec)
        for dead in (["a\u0001b"], ["\u0001"]):  # a byte the tiny tokenizer cannot spell
            with pytest.raises(grpc.RpcError) as err:
                client.complete(
                    prompt_token_ids=PROMPT,
                    max_tokens=8,
                    temperature=0,
                    structured_outputs={"choice": dead},
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "no token of the model's vocabulary can follow" in err.value.details()
        seconds_until_blocks_free(cluster)


LONG = [  # guided streams long enough to be cut: 400 tokens each on the byte tokenizer
    {"regex": "[a-z]{400}"},
    {"json": {"type": "array", "items": {"type": "boolean"}, "minItems": 200, "maxItems": 200}},
    {"grammar": "start: ROW+\nROW: /[a-c]{3};/"},
]
LONG_TOKENS = 400


def test_a_guided_stream_survives_its_decode_instance(chat_model, on_shared_ray):
    """Guided streams, the decode instance holding most of them SIGKILLed once each has 8
    tokens: each ends as the uninterrupted run, the migrated ones' delivered tokens
    replayed into the new decode instance's matcher."""
    from pdserve.cluster import launch

    kinds = [next(iter(spec)) for spec in LONG]
    guides = [
        Guide(k, s if isinstance(s, str) else json.dumps(s))
        for k, s in (next(iter(spec.items())) for spec in LONG)
    ]
    params = [SamplingParams(max_tokens=LONG_TOKENS, temperature=0, guide=g) for g in guides]
    want = [o.token_ids for o in LLM(chat_model).generate([PROMPT] * len(LONG), params)]
    config = disagg_config(chat_model, "gloo", True, 1)
    config["decode"].update(instances=2, resources={"num_cpus": 0.5})
    config["supervisor"] = SUPERVISOR
    with launch(config) as cluster, cluster.client() as client:
        tokens: list[list[int]] = [[] for _ in LONG]
        ends: list = [None] * len(LONG)

        def read(i: int) -> None:
            try:
                for chunk in client.generate(
                    prompt_token_ids=PROMPT,
                    max_tokens=LONG_TOKENS,
                    temperature=0,
                    structured_outputs=LONG[i],
                ):
                    tokens[i] += chunk.token_ids
                    if chunk.finish_reason is not None:
                        ends[i] = chunk
            except Exception as e:  # reported by the test
                ends[i] = e

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(LONG))]
        for t in threads:
            t.start()
        assert wait_until(lambda: min(map(len, tokens)) >= 1, 60), tokens
        victim, pid = busiest(cluster, "decode")
        assert wait_until(lambda: min(map(len, tokens)) >= 8, 60), tokens
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(120)
        for i, kind in enumerate(kinds):
            assert not isinstance(ends[i], Exception), (kind, ends[i])
            assert tokens[i] == want[i], (kind, ends[i].timings)
        migrated = [e for e in ends if e.timings.attempts > 1]
        assert migrated and all(victim in e.timings.instances for e in migrated), ends
        back_in_service(cluster, victim)
        seconds_until_blocks_free(cluster)
