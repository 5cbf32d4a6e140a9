"""Both front ends fuzzed against a live co-located cluster while greedy streams run:
schemathesis generates requests from docs/openapi.yaml (valid ones and ones that break
it), hypothesis generates ``GenerateRequest`` messages with extreme values. No 5xx, no
dropped connection, every response as the spec says (valid requests) or a 4xx
(invalid ones); over gRPC every call ends OK or with a status that names the client's
fault, never INTERNAL or UNKNOWN; the background streams equal the offline engine's
output; every KV block is free afterwards.

The cluster (``pdserve up``, two co-located instances) serves a tiny model whose context
is 64 tokens, so that whatever ``max_tokens`` a case asks for, it generates at most a
few dozen tokens. Hypothesis runs derandomized: the same cases each run (they change
with the spec and the counts in ``PLAN``), so a failure reproduces."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import grpc
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from pdserve.engine import LLM, SamplingParams
from pdserve.router.client import RouterClient
from tests.cluster.helpers import all_blocks_free, small_cluster_config, wait_until
from tests.router.pdserve_up import pdserve_up
from tests.tiny_models import TINY_SHAPES, save_tiny_chat_llama

SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
CONTEXT = 64
BACKGROUND = [[5 + i, 9, 33, 81] for i in range(3)]  # greedy streams of 56 tokens
BACKGROUND_TOKENS = 56
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]  # fmt: skip
# (path, mode, cases, stream forced on): ~2,100 cases in all, one test per row
PLAN = [  # chat cases cost most: without max_tokens they run to the end of the context
    ("/v1/completions", GenerationMode.POSITIVE, 550, False),
    ("/v1/completions", GenerationMode.POSITIVE, 250, True),
    ("/v1/chat/completions", GenerationMode.POSITIVE, 400, False),
    ("/v1/chat/completions", GenerationMode.POSITIVE, 150, True),
    ("/v1/completions", GenerationMode.NEGATIVE, 375, False),
    ("/v1/chat/completions", GenerationMode.NEGATIVE, 375, False),
]


@pytest.fixture(scope="module")
def fuzz_model(tmp_path_factory) -> str:
    """The suite's tiny chat model with a context of ``CONTEXT`` tokens."""
    folder = tmp_path_factory.mktemp("tiny-chat-64")
    save_tiny_chat_llama(folder, **TINY_SHAPES["gqa2"])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return str(folder)


@pytest.fixture(scope="module")
def fuzz_cluster(fuzz_model, tmp_path_factory):
    """``pdserve up`` in a process of its own: this folder's cluster may be up in the
    test process, and a process has one embedded Ray."""
    with pdserve_up(small_cluster_config(fuzz_model), tmp_path_factory.mktemp("fuzz")) as c:
        yield c


@pytest.fixture(scope="module")
def expected(fuzz_model) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=BACKGROUND_TOKENS, ignore_eos=True)
    return [o.token_ids for o in LLM(fuzz_model).generate(BACKGROUND, params)]


class Background:
    """Greedy streams over gRPC, one loop per prompt, from ``start`` until ``stop``:
    each stream's tokens are kept to compare with the offline engine's."""

    def __init__(self, address: str):
        self.address, self.done = address, threading.Event()
        self.streams: list[list[list[int]]] = [[] for _ in BACKGROUND]
        self.error: BaseException | None = None  # what ended a stream early
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        client = RouterClient(self.address)

        async def loop(i: int) -> None:
            while not self.done.is_set():
                done = await client.acomplete(prompt_token_ids=BACKGROUND[i], temperature=0,
                                              max_tokens=BACKGROUND_TOKENS, ignore_eos=True,
                                              timeout=120)  # fmt: skip
                self.streams[i].append(list(done.token_ids))

        try:
            await asyncio.gather(*(loop(i) for i in range(len(BACKGROUND))))
        except BaseException as e:  # any: __exit__ reports it
            self.error = e
        finally:
            await client.aclose()
            client.close()

    def __enter__(self):
        """Start the loops; return once a stream of each is in flight."""
        self.thread.start()
        with RouterClient(self.address) as client:
            running = wait_until(lambda: client.stats().in_flight >= len(BACKGROUND), 60)
        assert running and self.error is None, self.error
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive() and self.error is None, self.error


def served_spec(model: str) -> schemathesis.BaseSchema:
    """docs/openapi.yaml with ``model`` pinned to the served id (any other is a 404)."""
    raw = yaml.safe_load(SPEC.read_text())
    raw["components"]["schemas"]["Model"] = {"enum": [model]}
    return schemathesis.openapi.from_dict(raw)


def streaming(case):
    case.body = {**case.body, "stream": True}
    return case


PLAN_IDS = [f"{p[4:]}-{m.value}-{n}{'-stream' if s else ''}" for p, m, n, s in PLAN]


@pytest.mark.parametrize(("path", "mode", "examples", "stream"), PLAN, ids=PLAN_IDS)
def test_schemathesis_fuzzes_the_http_api_while_streams_run(
    fuzz_cluster, fuzz_model, expected, path, mode, examples, stream
):
    """One row of ``PLAN`` per test (each within the suite's per-test bound), then the
    GET operations once each in the last row's test."""
    schema = served_spec(fuzz_model)
    base = f"http://{fuzz_cluster.http_address}"
    cases: dict[str, int] = {}

    def fuzz(operation, mode: GenerationMode, examples: int, stream: bool) -> None:
        strategy = operation.as_strategy(generation_mode=mode)
        checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

        if stream:  # valid bodies rarely run with "stream": true otherwise
            strategy = strategy.map(streaming)

        @given(case=strategy)
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
        def run(case):
            response = case.call(base_url=base, timeout=60)  # a dropped connection raises
            case.validate_response(response, checks=checks)
            key = f"{operation.label} {mode.value}"
            cases[key] = cases.get(key, 0) + 1

        run()

    started = time.monotonic()
    with Background(fuzz_cluster.address) as background:
        fuzz(schema[path]["POST"], mode, examples, stream)
        if (path, mode, examples, stream) == PLAN[-1]:
            for get in ("/v1/models", "/health", "/metrics", "/metrics/targets"):
                fuzz(schema[get]["GET"], GenerationMode.POSITIVE, 1, False)
        assert all(background.streams), "a background stream did not finish during the fuzz"
    print(f"fuzzed {sum(cases.values())} cases in {time.monotonic() - started:.0f} s: {cases}")
    assert cases.get(f"POST {path} {mode.value}", 0) >= 0.9 * examples, cases
    for i, streams in enumerate(background.streams):
        assert all(tokens == expected[i] for tokens in streams), i
    with RouterClient(fuzz_cluster.address) as client:
        assert wait_until(lambda: all_blocks_free(client.stats()), 30), client.stats()


ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "", "wizard"])
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)  # protobuf: valid UTF-8
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
# per field: values a request may run with (extremes of the allowed range included), or any
SAMPLING = {
    "max_tokens": (st.integers(1, 2**31 - 1), INT32),
    "temperature": (st.one_of(st.just(0.0), st.floats(1e-5, 1e308)), st.floats()),
    "top_k": (st.integers(-1, 2**31 - 1), INT32),
    "top_p": (st.floats(5e-324, 1), st.floats()),
    "seed": (INT64, INT64),
}
OK_OR_CLIENTS_FAULT = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                       grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ALREADY_EXISTS,
                       grpc.StatusCode.RESOURCE_EXHAUSTED}  # fmt: skip


@st.composite
def generate_requests(draw):
    """Half of them with values a request may run with, half with any."""
    from pdserve.router import pdserve_pb2 as pb

    runs = draw(st.booleans())
    ascii_id = st.from_regex(r"[ -~]{0,20}", fullmatch=True)
    req = pb.GenerateRequest(request_id=draw(ascii_id if runs else TEXT))
    kind = draw(st.sampled_from(["prompt", "messages", "prompt_token_ids", None]))
    if kind == "prompt":
        req.prompt = draw(TEXT)
    elif kind == "messages":
        req.messages.SetInParent()
        for role, content in draw(st.lists(st.tuples(ROLES, TEXT), max_size=3)):
            req.messages.messages.add(role=role, content=content)
    elif kind == "prompt_token_ids":
        req.prompt_token_ids.SetInParent()
        ids = st.integers(0, 255) if runs else st.one_of(st.integers(0, 255), INT32)
        req.prompt_token_ids.ids.extend(draw(st.lists(ids, max_size=CONTEXT + 5)))
    for name, (running, anything) in SAMPLING.items():
        value = draw(st.one_of(st.none(), running if runs else anything))
        if value is not None:
            setattr(req.sampling, name, value)
    stop = st.text(min_size=1, max_size=8).filter(lambda t: t.isprintable()) if runs else TEXT
    req.sampling.stop.extend(draw(st.lists(stop, max_size=3)))
    req.sampling.stop_token_ids.extend(draw(st.lists(INT32, max_size=3)))
    req.sampling.ignore_eos = draw(st.booleans())
    return req


def test_hypothesis_fuzzes_grpc_generate(fuzz_cluster):
    from pdserve.router import pdserve_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(fuzz_cluster.address)
    stub = pb_grpc.RouterStub(channel)
    seen: dict[str, int] = {}

    @given(req=generate_requests())
    @settings(max_examples=600, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    def run(req):
        call = stub.Generate(req, timeout=60)
        try:
            messages = list(call)
            assert messages and messages[-1].finish_reason in ("stop", "length"), messages
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            assert code in OK_OR_CLIENTS_FAULT, (code, e.details(), req)
            assert "Traceback" not in e.details()
        seen[code.name] = seen.get(code.name, 0) + 1

    started = time.monotonic()
    try:
        run()
    finally:
        channel.close()
    print(f"gRPC: {sum(seen.values())} cases in {time.monotonic() - started:.0f} s: {seen}")
    assert seen.get("OK") and seen.get("INVALID_ARGUMENT"), seen


def test_bytes_that_are_no_generate_request_are_invalid_argument(fuzz_cluster):
    """A message protobuf cannot parse (a string field holding invalid UTF-8) is the
    client's fault: INVALID_ARGUMENT, not grpc's INTERNAL."""
    channel = grpc.insecure_channel(fuzz_cluster.address)
    generate = channel.unary_stream("/pdserve.v1.Router/Generate")
    try:
        for raw in (b"\x0a\x02\xff\xfe", b"\x0a\xff", b"\xff\xff\xff"):
            with pytest.raises(grpc.RpcError) as err:
                list(generate(raw, timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    finally:
        channel.close()
