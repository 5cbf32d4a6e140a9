"""The ``pdserve.v1.Router`` gRPC handlers: parse, validate, admit, stream, clean up."""

from __future__ import annotations

import time
import uuid

import grpc

from router.proto import pdserve_pb2 as pb
from router.proto import pdserve_pb2_grpc as pb_grpc
from router.stream import Delta, RequestStream
from router.validation import InvalidRequest

_STAT_FIELDS = (
    "queued",
    "running",
    "free_blocks",
    "total_blocks",
    "outstanding",
    "requests_total",
    "tokens_total",
    "steps_total",
)


def merge_waiting(delta: Delta, queue) -> Delta:
    """One message for every delta already waiting (a slow client gets fewer, larger ones)."""
    while delta.finish_reason is None and not queue.empty():
        more = queue.get_nowait()
        delta = Delta(
            delta.token_ids + more.token_ids, delta.text + more.text, more.finish_reason, more.error
        )
    return delta


class RouterService(pb_grpc.RouterServicer):
    def __init__(self, router):
        self.router = router  # router.server.RouterServer

    async def Generate(self, request, context):
        arrival = time.monotonic()
        router = self.router
        if router.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is draining")
        if not router.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the instances are still loading")
        if not router.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "every engine instance has failed")
        try:
            prompt_ids = router.validator.prompt_ids(request)
            params = router.validator.sampling(request)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in router.streams:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id={request_id!r}: already in flight"
            )
        stream = RequestStream(request_id, prompt_ids, params, arrival=arrival)
        if not router.admit(stream):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"admission queue full: {router.admission.max_size} requests are waiting "
                "for an instance (router.max_queue); retry later",
            )
        try:
            await context.send_initial_metadata((("request-id", request_id),))
            while True:
                delta = merge_waiting(await stream.queue.get(), stream.queue)
                if delta.error is not None:
                    await context.abort(grpc.StatusCode.INTERNAL, delta.error)
                yield stream.response(delta)
                if delta.finish_reason is not None:
                    return
        finally:
            router.finish(stream)  # the client went away, or the stream ended

    async def Abort(self, request, context):
        stream = self.router.streams.get(request.request_id)
        found = stream is not None and self.router.cancel(stream, "abort")
        return pb.AbortResponse(found=found)

    async def Stats(self, request, context):
        s = await self.router.stats()
        out = pb.StatsResponse(
            queued=s["queued"],
            max_queue=s["max_queue"],
            in_flight=s["in_flight"],
            draining=s["draining"],
        )
        for inst in s["instances"]:
            out.instances.append(
                pb.InstanceStats(
                    name=inst["name"],
                    role=inst["role"],
                    **{k: inst[k] for k in _STAT_FIELDS if k in inst},
                )
            )
        return out
