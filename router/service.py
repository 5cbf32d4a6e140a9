"""The ``pdserve.v1.Router`` gRPC handlers: parse, validate, admit, stream, clean up."""

from __future__ import annotations

import time

import grpc

from router import pdserve_pb2 as pb
from router import pdserve_pb2_grpc as pb_grpc
from router.server import Refused
from router.stream import merge_waiting

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


class RouterService(pb_grpc.RouterServicer):
    def __init__(self, router):
        self.router = router  # router.server.RouterServer

    async def Generate(self, request, context):
        try:
            stream = self.router.open_stream(request, time.monotonic())
        except Refused as e:
            await context.abort(e.code, e.message)
        request_id = stream.request_id
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
            self.router.finish(stream)  # the client went away, or the stream ended

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
