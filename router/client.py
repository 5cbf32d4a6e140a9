"""``RouterClient``: the Python client of the router's gRPC API, sync and async.

    client = RouterClient("127.0.0.1:50051")
    for chunk in client.generate("Hello", max_tokens=32):      # streams
        print(chunk.text, end="")
    done = client.complete(messages=[{"role": "user", "content": "Hi"}])
    async for chunk in client.agenerate("Hello"): ...           # same, on asyncio

A stream cancels its request (the router frees its KV blocks) when the caller stops
iterating: ``break`` out of the loop, ``stream.cancel()``, leaving a ``with`` block
or dropping the stream. Errors arrive as ``grpc.RpcError`` (``.code()``,
``.details()``): INVALID_ARGUMENT for a request that cannot run, RESOURCE_EXHAUSTED
when the router's queue is full, UNAVAILABLE while it starts or drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router import pdserve_pb2 as pb
from router import pdserve_pb2_grpc as pb_grpc
from router.client_outputs import Chunk, Completion, Timings, TokenLogprobs, chunk_of

__all__ = ["Chunk", "Completion", "RouterClient", "Timings", "TokenLogprobs", "make_request"]


def make_request(
    prompt: str | None = None,
    *,
    messages: list[dict] | None = None,
    prompt_token_ids: list[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: list[str] | str = (),
    stop_token_ids: list[int] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    logprobs: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
) -> pb.GenerateRequest:
    """A ``GenerateRequest``: exactly one of prompt, messages, prompt_token_ids.
    ``logprobs=N`` (0-20) has every chunk carry its tokens' ``TokenLogprobs`` with N
    alternatives; the penalties are OpenAI's (presence, frequency) and vLLM's
    (repetition); None leaves a field unset (the engine's default)."""
    given = [x is not None for x in (prompt, messages, prompt_token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
    req = pb.GenerateRequest(request_id=request_id)
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.SetInParent()  # set even when empty, so the router says what is wrong
        req.messages.messages.extend(pb.ChatMessage(**m) for m in messages)
    else:
        req.prompt_token_ids.SetInParent()
        req.prompt_token_ids.ids.extend(prompt_token_ids)
    s = req.sampling
    for name, value in dict(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        logprobs=logprobs,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
    ).items():
        if value is not None:
            setattr(s, name, value)
    s.stop.extend([stop] if isinstance(stop, str) else stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    return req


class Stream:
    """Iterator of ``Chunk``s of one request; cancels the request if left early."""

    def __init__(self, call):
        self._call, self._it, self.done = call, iter(call), False

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        if self.done:
            raise StopIteration
        try:
            chunk = chunk_of(next(self._it))
        except StopIteration:
            self.done = True
            raise
        except BaseException:
            self.done = True
            raise
        self.done = chunk.finished
        return chunk

    @property
    def request_id(self) -> str:
        return dict(self._call.initial_metadata() or ()).get("request-id", "")

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self._call.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the channel may be gone
            self.cancel()


class AsyncStream:
    """Async iterator of ``Chunk``s; cancels the request if left early."""

    def __init__(self, call):
        self._call, self.done = call, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if self.done:
            raise StopAsyncIteration
        try:
            msg = await self._call.read()
        except BaseException:
            self.cancel()
            raise
        if msg is grpc.aio.EOF:
            self.done = True
            raise StopAsyncIteration
        chunk = chunk_of(msg)
        self.done = chunk.finished
        return chunk

    async def request_id(self) -> str:
        return dict(await self._call.initial_metadata() or ()).get("request-id", "")

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.cancel()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the channel may be gone
            self.cancel()


class RouterClient:
    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.RouterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._aio: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> channel

    # ---- sync ----

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> Stream:
        """Stream a completion; keywords as ``make_request``."""
        return Stream(self._stub.Generate(make_request(prompt, **kw), timeout=timeout))

    def complete(self, prompt: str | None = None, **kw) -> Completion:
        out = Completion()
        for chunk in self.generate(prompt, **kw):
            out.add(chunk)
        return out

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(pb.AbortRequest(request_id=request_id)).found

    def stats(self) -> pb.StatsResponse:
        return self._stub.Stats(pb.StatsRequest())

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """SERVING, NOT_SERVING, ... from the standard grpc.health.v1 service."""
        req = health_pb2.HealthCheckRequest(service=service)
        status = self._health.Check(req, timeout=timeout).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- async (a channel per event loop) ----

    def _astub(self) -> pb_grpc.RouterStub:
        loop = asyncio.get_running_loop()
        if loop not in self._aio:
            channel = grpc.aio.insecure_channel(self.address)
            self._aio[loop] = (channel, pb_grpc.RouterStub(channel))
        return self._aio[loop][1]

    def agenerate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kw
    ) -> AsyncStream:
        """``async for chunk in client.agenerate(...)``; keywords as ``make_request``."""
        return AsyncStream(self._astub().Generate(make_request(prompt, **kw), timeout=timeout))

    async def acomplete(self, prompt: str | None = None, **kw) -> Completion:
        out = Completion()
        async for chunk in self.agenerate(prompt, **kw):
            out.add(chunk)
        return out

    async def astats(self) -> pb.StatsResponse:
        return await self._astub().Stats(pb.StatsRequest())

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        if loop in self._aio:
            await self._aio.pop(loop)[0].close()
