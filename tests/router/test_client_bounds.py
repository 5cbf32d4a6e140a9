"""How long and how much an HTTP or gRPC client may hold (router/http_gate.py,
router/admission.py): both front ends served for real (aiohttp and grpc.aio on this
test's loop, raw sockets, httpx and the gRPC client) over a core whose every request
streams text for as long as it is read (``FloodCore``). A connection without headers
in time is closed, a body not in time is 408, a stream its client does not read is
ended; without API keys one address holds at most its share of generate calls, with
keys the bound is the key's."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import httpx
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.admission import CallLimit
from pdserve.router.auth import ApiKeys
from pdserve.router.client import RouterClient
from pdserve.router.grpc_api import GrpcApi
from pdserve.router.grpc_gate import peer_address
from pdserve.router.http_api import HttpApi
from pdserve.router.http_gate import HttpTimeouts
from pdserve.router.metrics import RouterMetrics
from pdserve.router.stream import Delta, RequestStream

TIMEOUT_S = 0.5
TIMEOUTS = HttpTimeouts(header_s=TIMEOUT_S, body_s=TIMEOUT_S, write_s=TIMEOUT_S)
CHUNK = "x" * 4096


class FloodCore:
    """Every request streams ``CHUNK`` a millisecond until the front end finishes it."""

    serving = True
    tokenizer = None

    def __init__(self, calls: CallLimit):
        self.calls = calls
        self.metrics = RouterMetrics("m", {"ttft_ms": 1000.0, "tpot_ms": 150.0})
        self.finished: list[float] = []  # when each stream was finished
        self._floods: set[asyncio.Task] = set()

    async def open_stream(self, request, arrival, deadline=None, owner="", front=None):
        stream = RequestStream(f"r{len(self._floods)}", [1], SamplingParams(max_tokens=10**6))
        task = asyncio.get_running_loop().create_task(self._flood(stream))
        self._floods.add(task)
        task.add_done_callback(self._floods.discard)
        return stream

    async def _flood(self, stream: RequestStream) -> None:
        while not stream.finished:
            stream.deliver(Delta([1], CHUNK))
            await asyncio.sleep(0.001)

    def finish(self, stream: RequestStream) -> None:
        stream.finished = True
        self.finished.append(time.monotonic())

    def refusals(self, reason: str) -> float:
        for family in self.metrics.refusals.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels["reason"] == reason:
                    return sample.value
        raise AssertionError(f"no refusals of reason {reason!r}")


def _serve(check, calls: CallLimit | None = None, keys: ApiKeys | None = None) -> None:
    """Run ``check(core, http_port, grpc_port)`` against both front ends of a FloodCore."""

    async def run():
        core = FloodCore(calls or CallLimit(8))
        http_api = HttpApi(core, "m", keys, timeouts=TIMEOUTS)
        grpc_api = GrpcApi(core, keys)
        http_port = await http_api.start("127.0.0.1", 0)
        grpc_port = await grpc_api.start("127.0.0.1", 0)
        try:
            await check(core, http_port, grpc_port)
        finally:
            await grpc_api.stop(0)
            await http_api.stop()

    asyncio.run(run())


async def _closed_after(sock: socket.socket, until: bytes | None = None) -> tuple[float, bytes]:
    """Seconds until the server closes ``sock`` (or sends what ends with ``until``), and
    what it sent; a TimeoutError past 20 s."""
    started, got = time.monotonic(), b""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    while until is None or not got.endswith(until):
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 20)
        except ConnectionResetError:
            break
        if not data:
            break
        got += data
    return time.monotonic() - started, got


def _connect(port: int, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _post(path: str, body: bytes, length: int | None = None) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    ).encode() + body


@pytest.mark.timeout(60)
def test_a_connection_without_headers_in_time_is_closed():
    async def check(core, http_port, grpc_port):
        silent, partial, kept = (_connect(http_port) for _ in range(3))
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then idle
        waits = await asyncio.gather(*(_closed_after(s) for s in (silent, partial, kept)))
        for s in (silent, partial, kept):
            s.close()
        # closed between the timeout and two sweeps past it (a generous bound here)
        for waited, _ in waits:
            assert TIMEOUT_S * 0.9 < waited < TIMEOUT_S + 3, waits
        assert waits[0][1] == waits[1][1] == b""
        assert waits[2][1].startswith(b"HTTP/1.1 200 OK") and waits[2][1].endswith(b"ok")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
            assert (await http.get("/health")).status_code == 200  # in time: served

    _serve(check)


@pytest.mark.timeout(60)
def test_a_body_not_in_within_the_timeout_is_408_and_frees_its_place():
    async def check(core, http_port, grpc_port):
        sock = _connect(http_port)
        sock.sendall(_post("/v1/completions", b"{", length=100))
        waited, got = await _closed_after(sock, until=b"}}")
        sock.close()
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert b"request body: not received within router.body_timeout_s=0.5" in got
        assert TIMEOUT_S * 0.9 < waited < TIMEOUT_S + 5
        assert b"Connection: close" in got
        assert core.calls.active == 0 and core.refusals("body_timeout") == 1

    _serve(check)


@pytest.mark.timeout(60)
def test_a_stream_its_client_does_not_read_is_ended_after_the_write_timeout():
    async def check(core, http_port, grpc_port):
        sock = _connect(http_port, rcvbuf=4096)
        started = time.monotonic()
        sock.sendall(_post("/v1/completions", b'{"prompt": "hi", "stream": true}'))
        for _ in range(2000):  # it reads nothing: the router's writes stall, then end
            if core.finished:
                break
            await asyncio.sleep(0.01)
        ended = core.finished[0] - started if core.finished else None
        sock.close()
        assert ended is not None and TIMEOUT_S < ended < 15, ended
        assert core.calls.active == 0

    _serve(check)


@pytest.mark.timeout(60)
def test_without_keys_one_address_holds_at_most_its_bound_of_calls():
    calls = CallLimit(8, per_address=2)

    async def check(core, http_port, grpc_port):
        client = RouterClient(f"127.0.0.1:{grpc_port}")
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}")
        body = {"prompt": "hi", "stream": True}
        held = [client.agenerate(prompt_token_ids=[1]) for _ in range(2)]
        try:
            for stream in held:
                await stream.__anext__()  # its call holds a place
            assert calls.by_address == {"127.0.0.1": 2}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 429, r.text
            message = r.json()["error"]["message"]
            assert "2 requests in progress from address 127.0.0.1" in message
            assert "router.max_concurrent_requests_per_address=2" in message
            with pytest.raises(grpc.RpcError) as err:
                await client.acomplete(prompt_token_ids=[1])
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "router.max_concurrent_requests_per_address=2" in err.value.details()
            assert core.refusals("concurrency_per_address") == 2
            other = _connect(http_port, source="127.0.0.2")  # another address: served
            other.sendall(_post("/v1/completions", b'{"prompt": "hi", "stream": true}'))
            other.setblocking(False)
            first = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(other, 64), 10)
            assert first.startswith(b"HTTP/1.1 200 OK"), first
            assert calls.by_address == {"127.0.0.1": 2, "127.0.0.2": 1}
            other.close()
        finally:
            for stream in held:
                stream.cancel()
            await client.aclose()
            await http.aclose()
        for _ in range(500):
            if calls.active == 0:
                break
            await asyncio.sleep(0.01)
        assert calls.active == 0 and calls.by_address == {}

    _serve(check, calls)


@pytest.mark.timeout(60)
def test_with_keys_the_address_is_not_counted():
    calls = CallLimit(8, per_address=1)
    keys = ApiKeys(["k-one"])

    async def check(core, http_port, grpc_port):
        client = RouterClient(f"127.0.0.1:{grpc_port}", api_key="k-one")
        held = [client.agenerate(prompt_token_ids=[1]) for _ in range(2)]
        try:
            for stream in held:
                await stream.__anext__()
            assert calls.active == 2 and calls.by_address == {}
        finally:
            for stream in held:
                stream.cancel()
            await client.aclose()

    _serve(check, calls, keys)


def test_peer_address_drops_the_port():
    assert peer_address("ipv4:10.0.0.7:5123") == "10.0.0.7"
    assert peer_address("ipv6:%5B::1%5D:5123") == "::1"
    assert peer_address("ipv6:[fe80::1]:80") == "fe80::1"
    assert peer_address("unix:/tmp/s") == "unix:/tmp/s"
