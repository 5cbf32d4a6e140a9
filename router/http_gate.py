"""What stands between an HTTP client and the handlers of the HTTP front end
(router/http_api.py): the API keys (``authenticate``) and the time a client may hold
the router's resources (docs/serving.md, "Authentication, TLS and limits"):

- ``HeaderDeadlines``: a connection whose first request's headers are not in within
  ``router.header_timeout_s`` of its opening is closed; a kept-alive connection's next
  request has as long from the previous response's end (aiohttp's keep-alive timeout,
  which router/http_api.py sets to the same), so no connection sits idle or half-sent
  longer.
- ``read_body``: a generate call's body must be in within ``router.body_timeout_s`` of
  its headers, else ``BodyTimeout`` (the front end answers 408 and closes).
- ``write`` (``Events``): one write of a streamed response that the client takes
  nothing of for ``router.write_timeout_s`` ends the connection
  (``ConnectionResetError``, as a client that went away). A whole (unstreamed) response
  is handed to aiohttp once the call's place is given back, and is not bounded here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from pdserve.router.auth import ApiKeys, refusal
from pdserve.router.incidents import internal_error
from pdserve.router.openai_shapes import error_body, error_response

OPEN_PATHS = ("/health",)  # probes: answered without a key
SWEEPS_PER_TIMEOUT = 4  # how often HeaderDeadlines looks, per header timeout (at most 1 s)
REQUEST_ID = "X-Request-Id"  # the header that names a request (a generate's and its response's)


@dataclass(frozen=True)
class HttpTimeouts:
    """``router.header_timeout_s``, ``body_timeout_s`` and ``write_timeout_s`` (their
    defaults: cluster/config.py's)."""

    header_s: float = 60.0
    body_s: float = 60.0
    write_s: float = 60.0

    @classmethod
    def from_config(cls, router_config: dict) -> HttpTimeouts:
        return cls(
            router_config["header_timeout_s"],
            router_config["body_timeout_s"],
            router_config["write_timeout_s"],
        )


class BodyTimeout(Exception):
    """A request body not in within ``router.body_timeout_s``; the message says so."""


def authenticate(keys: ApiKeys, refused: Callable[[str], None]):
    """A middleware: the caller's owner in ``request["owner"]`` (router/auth.py), or 401
    in OpenAI's shape (counted with ``refused("unauthenticated")``); every path but
    ``OPEN_PATHS`` needs a known key."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        owner = keys.owner(request.headers.get("Authorization"))
        if owner is None:
            refused("unauthenticated")
            resp = error_response(401, refusal("the Authorization header"))
            resp.headers["WWW-Authenticate"] = 'Bearer realm="pdserve"'
            return resp
        request["owner"] = owner
        return await handler(request)

    return middleware


class HeaderDeadlines:
    """Closes the connections of ``runner`` (an aiohttp ``AppRunner``) whose first
    request's headers did not come in ``timeout_s`` after the connection was first seen.

    Invariants: ``middleware`` marks a connection as soon as any request's headers are
    in (before any other middleware); a sweep every ``timeout_s / SWEEPS_PER_TIMEOUT``
    (at most 1 s) notes new connections and force-closes the unmarked ones noted
    ``timeout_s`` ago or more, so such a connection lives at most ``timeout_s`` plus two
    sweeps. What it keeps is only the connections the server holds now."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.sweep_s = min(timeout_s / SWEEPS_PER_TIMEOUT, 1.0)
        self._seen: dict[web.RequestHandler, float] = {}  # connection -> when a sweep first saw it
        self._headed: set = set()  # connections a request's headers came in on
        self._task: asyncio.Task | None = None

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        self._headed.add(request.protocol)
        return await handler(request)

    def start(self, runner: web.AppRunner) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sweep(runner))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sweep(self, runner: web.AppRunner) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            now = time.monotonic()
            assert runner.server is not None  # set up: HttpApi.start starts this after it
            held = runner.server.connections
            self._seen = {c: self._seen.get(c, now) for c in held}
            self._headed.intersection_update(self._seen)
            for conn, seen in self._seen.items():
                if conn not in self._headed and now - seen >= self.timeout_s:
                    conn.force_close()


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request's body (aiohttp's 413 past ``client_max_size`` passes through);
    ``BodyTimeout`` when it is not all in within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout(
            f"request body: not received within router.body_timeout_s={timeout_s:g}"
        ) from None


async def write(request: web.Request, sending: Awaitable[None], timeout_s: float) -> None:
    """Await ``sending`` (a write to ``request``'s response, or its end); a client that
    takes none of what is buffered for ``timeout_s`` has its connection aborted (nothing
    more is buffered for it) and the write raises ``ConnectionResetError``."""
    try:
        async with asyncio.timeout(timeout_s):
            await sending
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(
            f"the client read nothing for router.write_timeout_s={timeout_s:g}"
        ) from None


class Events:
    """The server-sent events of one streamed response, each write bounded by ``write``."""

    def __init__(self, request: web.Request, resp: web.StreamResponse, timeout_s: float):
        self.request, self.resp, self.timeout_s = request, resp, timeout_s

    async def send(self, payload: dict, last: bool = False, event_id: int | None = None) -> None:
        """One event; ``event_id``: its ``id:`` line (what a client resumes after)."""
        head = "" if event_id is None else f"id: {event_id}\n"
        data = f"{head}data: {json.dumps(payload)}\n\n".encode()
        await write(self.request, self.resp.write(data), self.timeout_s)
        if last:
            await write(self.request, self.resp.write_eof(), self.timeout_s)

    async def end(self) -> None:
        """``[DONE]``, then the end of the response."""
        await write(self.request, self.resp.write(b"data: [DONE]\n\n"), self.timeout_s)
        await write(self.request, self.resp.write_eof(), self.timeout_s)


@contextlib.asynccontextmanager
async def stream_guard(events: Events, what: str) -> AsyncIterator[None]:
    """Around the writes of a streamed response (its status line sent): the client
    going away ends it quietly; an unexpected exception ends it with an error event
    naming an incident id (the traceback in the log only, ``internal_error``)."""
    try:
        yield
    except ConnectionResetError:  # the client went away; the caller finishes its streams
        pass
    except Exception:
        message = internal_error(what)
        with contextlib.suppress(ConnectionResetError):
            await events.send(error_body(500, message), last=True)
