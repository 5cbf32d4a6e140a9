"""The streams ``RouterClient`` hands out (router/client.py): iterators of ``Chunk``s of
one request, sync (``Stream``) and async (``AsyncStream``), that resume by themselves.

A stream counts the tokens it received. When its call breaks with UNAVAILABLE after the
router admitted the request (it sent the ``request-id`` header, or a chunk came: the
router's process died, or it is being restarted and rebuilds its view), it opens a
``Resume`` call for its request id after that count, waiting ``BACKOFF_S`` (doubling,
at most ``MAX_BACKOFF_S``) before each try, until ``until`` (monotonic): the caller
sees the chunks continue, exactly the tokens an unbroken stream would have given (the
router sends only those after the count). Any other error, or UNAVAILABLE past
``until``, reaches the caller as ``grpc.RpcError``, and so does UNAVAILABLE for a
request never admitted (the router loading or draining refused it). A stream cancels
its request when left early.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc

from router.client_types import Chunk, read_chunk

BACKOFF_S = 0.1
MAX_BACKOFF_S = 1.0

# (request id, tokens received, timeout) -> a new call streaming the rest
Resumer = Callable[[str, int, float], object]


class _Resuming:
    """What both streams share: the request id, the count, the backoff."""

    def __init__(self, call, request_id: str, resume: Resumer, until: float):
        self._call, self._request_id, self._resume, self._until = call, request_id, resume, until
        self.done = False
        self.received = 0  # tokens of the request received so far
        self.resumed = 0  # times the stream was resumed
        self._backoff = BACKOFF_S

    @property
    def request_id(self) -> str:
        return self._request_id

    def _retry_in(self, error: BaseException, metadata) -> float | None:
        """Seconds to wait before resuming after ``error`` (``metadata``: the broken
        call's initial metadata); None: it is final."""
        if not isinstance(error, grpc.RpcError) or error.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        admitted = self.received or self.resumed or "request-id" in dict(metadata or ())
        if not admitted:
            return None
        left = self._until - time.monotonic()
        if left <= 0:
            return None
        wait, self._backoff = min(self._backoff, left), min(self._backoff * 2, MAX_BACKOFF_S)
        return wait

    def _reopen(self):
        self.resumed += 1
        left = max(0.001, self._until - time.monotonic())
        return self._resume(self._request_id, self.received, left)

    def _took(self, chunk: Chunk) -> Chunk:
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

    def __init__(self, call, request_id: str, resume: Resumer, until: float):
        super().__init__(call, request_id, resume, until)
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
                wait = self._retry_in(e, self._call.initial_metadata() if ended else None)
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
                metadata = None
                if isinstance(e, grpc.RpcError):  # the call ended: its metadata is in
                    metadata = await self._call.initial_metadata()
                wait = self._retry_in(e, metadata)
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
