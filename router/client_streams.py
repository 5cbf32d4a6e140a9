"""The streams ``RouterClient`` hands out (router/client.py): iterators of ``Chunk``s of
one request, sync (``Stream``) and async (``AsyncStream``), that resume by themselves.

A stream counts the tokens it received. When its call breaks with UNAVAILABLE after the
router admitted the request (it sent the ``request-id`` header, or a chunk came: the
router's process died, or it is being restarted and rebuilds its view), it opens a
``Resume`` call for its request id after that count. When the call broke before any sign
of admission and no router refused it (a refusal carries ``pdserve-refusal`` trailing
metadata: loading, draining), the request may or may not have reached an instance
before its router died: the stream probes with ``Resume`` from token 0, and when no
router holds the request (INVALID_ARGUMENT) sends the same ``Generate`` again (the same
request id). Each try waits ``BACKOFF_S`` (doubling, at most ``MAX_BACKOFF_S``), until
``until`` (monotonic): the caller sees the chunks continue, exactly the tokens an
unbroken stream would have given (the router sends only those after the count). Any
other error, UNAVAILABLE past ``until``, or a router's refusal of the first call reaches
the caller as ``grpc.RpcError``. A stream cancels its request when left early.

State machine of the call under way (``_phase``): ``generate`` (the first call, or one
sent again) -> ``resume`` (admitted, broken: the rest after the count) or ``probe``
(never admitted, broken, not refused: Resume from 0); ``probe`` -> ``resume`` (a router
holds it) or ``generate`` (none does).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc

from pdserve.router.client_types import Chunk, read_chunk

BACKOFF_S = 0.1
MAX_BACKOFF_S = 1.0

# (request id, tokens received, timeout) -> a new call streaming the rest
Resumer = Callable[[str, int, float], object]
# (timeout) -> the request's Generate call again
Regenerator = Callable[[float], object]
GENERATE, RESUME, PROBE = "generate", "resume", "probe"


class _Resuming:
    """What both streams share: the request id, the count, the phase, the backoff."""

    def __init__(
        self, call, request_id: str, resume: Resumer, regenerate: Regenerator, until: float
    ):
        self._call, self._request_id, self._until = call, request_id, until
        self._resume, self._regenerate = resume, regenerate
        self.done = False
        self.received = 0  # tokens of the request received so far
        self.resumed = 0  # times the stream was reopened
        self._phase = GENERATE
        self._next = GENERATE  # the phase the next reopen starts
        self._admitted = False  # a router took the request (header or chunk seen)
        self._backoff = BACKOFF_S

    @property
    def request_id(self) -> str:
        return self._request_id

    def _retry_in(self, error: BaseException, initial, trailing) -> float | None:
        """Seconds to wait before reopening after ``error`` (``initial``, ``trailing``:
        the broken call's metadata), choosing ``_next``; None: it is final."""
        if not isinstance(error, grpc.RpcError):
            return None
        self._admitted = self._admitted or "request-id" in dict(initial or ())
        code = error.code()
        if self._phase == PROBE and code == grpc.StatusCode.INVALID_ARGUMENT:
            self._next = GENERATE  # no router holds it: it never reached an instance
        elif code != grpc.StatusCode.UNAVAILABLE:
            return None
        elif self._admitted:
            self._next = RESUME
        elif self._phase == GENERATE and "pdserve-refusal" in dict(trailing or ()):
            return None  # a router answered: it refuses the request (loading, draining)
        else:
            self._next = PROBE
        left = self._until - time.monotonic()
        if left <= 0:
            return None
        wait, self._backoff = min(self._backoff, left), min(self._backoff * 2, MAX_BACKOFF_S)
        return wait

    def _reopen(self):
        self.resumed += 1
        self._phase = self._next
        left = max(0.001, self._until - time.monotonic())
        if self._phase == GENERATE:
            return self._regenerate(left)
        return self._resume(self._request_id, self.received, left)

    def _took(self, chunk: Chunk) -> Chunk:
        self._admitted = True
        self.received += len(chunk.token_ids)
        self._backoff = BACKOFF_S
        self.done = chunk.finished
        return chunk

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self._call.cancel()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the channel may be gone
            self.cancel()


class Stream(_Resuming):
    """Iterator of ``Chunk``s of one request; resumes a broken call; cancels the request
    if left early."""

    def __init__(
        self, call, request_id: str, resume: Resumer, regenerate: Regenerator, until: float
    ):
        super().__init__(call, request_id, resume, regenerate, until)
        self._it = iter(call)

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        while not self.done:
            try:
                return self._took(read_chunk(next(self._it)))
            except StopIteration:
                self.done = True
                raise
            except BaseException as e:
                ended = isinstance(e, grpc.RpcError)  # the call ended: its metadata is in
                initial = self._call.initial_metadata() if ended else None
                trailing = self._call.trailing_metadata() if ended else None
                wait = self._retry_in(e, initial, trailing)
                if wait is None:
                    self.done = True
                    raise
            time.sleep(wait)
            self._call = self._reopen()
            self._it = iter(self._call)
        raise StopIteration

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()


class AsyncStream(_Resuming):
    """Async iterator of ``Chunk``s; resumes a broken call; cancels the request if left
    early."""

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        while not self.done:
            try:
                msg = await self._call.read()
            except BaseException as e:
                initial = trailing = None
                if isinstance(e, grpc.RpcError):  # the call ended: its metadata is in
                    initial = await self._call.initial_metadata()
                    trailing = await self._call.trailing_metadata()
                wait = self._retry_in(e, initial, trailing)
                if wait is None:
                    self.cancel()
                    raise
            else:
                if msg is grpc.aio.EOF:
                    self.done = True
                    break
                return self._took(read_chunk(msg))
            await asyncio.sleep(wait)
            self._call = self._reopen()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.cancel()
