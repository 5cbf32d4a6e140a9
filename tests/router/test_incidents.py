"""Clients never see server tracebacks: both front ends, served for real (grpc.aio and
aiohttp on this test's loop, the official grpc client and httpx) over a core whose
every call fails with an exception text that must not leak, answer one line naming an
incident id; an instance failure's extra lines stay in the log. Also: a slow reader's
stream holds one merged delta, and a refusal comes after the tokens before it."""

from __future__ import annotations

import asyncio
import logging

import grpc
import httpx
import pytest

from pdserve.router import pdserve_pb2 as pb
from pdserve.router.admission import CallLimit
from pdserve.router.client import RouterClient
from pdserve.router.grpc_api import GrpcApi
from pdserve.router.http_api import HttpApi
from pdserve.router.incidents import one_line
from pdserve.router.metrics import RouterMetrics
from pdserve.router.request import Refusal, Refused
from pdserve.router.stream import Delta, RequestStream

SECRET = "secret-internal-state\nTraceback (most recent call last):\n  File 'x.py'"


class BrokenCore:
    """Every request-serving call raises an unexpected exception."""

    def __init__(self):
        self.calls = CallLimit(4)
        self.metrics = RouterMetrics("m", {"ttft_ms": 1000.0, "tpot_ms": 150.0})

    async def open_stream(self, request, arrival, deadline=None, owner="", front=None):
        raise RuntimeError(SECRET)

    async def abort_anywhere(self, request_id, owner=""):
        raise KeyError(SECRET)

    async def stats(self):
        raise ValueError(SECRET)


def test_internal_errors_reach_clients_as_one_line_with_an_incident_id(caplog):
    async def run():
        core = BrokenCore()
        grpc_api, http_api = GrpcApi(core), HttpApi(core, "m")
        port = await grpc_api.start("127.0.0.1", 0)
        http_port = await http_api.start("127.0.0.1", 0)
        client = RouterClient(f"127.0.0.1:{port}")
        try:
            for call in (
                lambda: client.acomplete("hi"),
                lambda: client.astats(),
                lambda: client._astub().Abort(pb.AbortRequest(request_id="x")),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    await call()
                assert err.value.code() == grpc.StatusCode.INTERNAL
                _one_line_with_incident(err.value.details())
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
                r = await http.post("/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 500
                error = r.json()["error"]
                assert error["type"] == "server_error" and error["code"] == 500
                _one_line_with_incident(error["message"])
                assert core.calls.active == 0
        finally:
            await client.aclose()
            await grpc_api.stop(0)
            await http_api.stop()

    with caplog.at_level(logging.ERROR, logger="router.incidents"):
        asyncio.run(run())
    logged = [r for r in caplog.records if "internal error (incident" in r.getMessage()]
    assert len(logged) == 4 and all(SECRET.splitlines()[0] in r.exc_text for r in logged)


def _one_line_with_incident(message: str) -> None:
    assert "incident " in message and "\n" not in message
    assert "secret" not in message and "Traceback" not in message, message


def test_an_instance_failure_shows_its_first_line_and_an_incident_and_logs_the_rest(caplog):
    with caplog.at_level(logging.ERROR, logger="router.incidents"):
        short = one_line("instance colocated-0 failed: gone")
        shown = one_line(f"instance colocated-0 failed: {SECRET}")
    assert short.startswith("instance colocated-0 failed: gone (incident ")
    assert shown.startswith("instance colocated-0 failed: secret-internal-state (incident ")
    assert "Traceback" not in shown and "Traceback" in caplog.text
    for line in (short, shown):  # each id names the log record of its whole text
        incident = line.split("(incident ")[1].split(";")[0]
        assert f"(incident {incident})" in caplog.text


def test_an_unread_stream_holds_one_merged_delta():
    async def run():
        stream = RequestStream("r", [1, 2], None)
        for i in range(1000):
            stream.deliver(Delta([i], f"{i},"))
        assert stream.waiting.token_ids == list(range(1000))  # one delta, not a thousand
        stream.deliver(Delta([], "", refused=Refused(Refusal.DEADLINE, "late")))
        stream.deliver(Delta([7], "ignored: the stream ended"))
        first = await stream.read()
        assert first.token_ids == list(range(1000)) and first.finish_reason is None
        with pytest.raises(Refused, match="late"):
            await stream.read()

    asyncio.run(run())
