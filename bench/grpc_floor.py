"""What a streamed gRPC call costs before the router does anything: the floor under the
router's gRPC path in bench/serving_overhead.py.

``GrpcFloor`` serves ``pdserve.v1.Router``'s ``Generate`` (router/pdserve.proto) from
an echo in a process of its own: no router core, no engine, no tokenizer. Each call
gets what the router sends a request of ``max_tokens`` tokens produced one per engine
step: the ``request-id`` initial metadata, then ``max_tokens`` messages of one token
each, one per turn of the event loop, the last with a finish reason. It runs on
``grpc.aio`` as router/grpc_api.py does, so its CPU time per call is what any Python
gRPC server on this machine pays for the call, and the router's CPU per request minus
it is the router's own work (validation, admission, placement, the update feeds).
The caller is the router path's own (``RouterClient``), so its CPU compares too.
"""

from __future__ import annotations

import asyncio
import multiprocessing

import grpc

from pdserve.router import pdserve_pb2 as pb
from pdserve.router import pdserve_pb2_grpc as pb_grpc


class _Echo(pb_grpc.RouterServicer):
    async def Generate(self, request, context):
        count = request.sampling.max_tokens
        await context.send_initial_metadata((("request-id", "floor"),))
        for i in range(count):
            await asyncio.sleep(0)  # one message per turn, as deliveries arrive per step
            msg = pb.GenerateResponse(request_id="floor", token_ids=[i])
            if i == count - 1:
                msg.finish_reason = "length"
            yield msg


def _serve(ports) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_RouterServicer_to_server(_Echo(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


class GrpcFloor:
    """The echo server in a spawned process on loopback (``address``, ``pid``), until
    ``close``."""

    def __init__(self, start_timeout_s: float = 60.0):
        context = multiprocessing.get_context("spawn")  # no fork of a process running grpc
        ports = context.Queue()
        self._process = context.Process(target=_serve, args=(ports,), daemon=True)
        self._process.start()
        self.pid = self._process.pid
        self.address = f"127.0.0.1:{ports.get(timeout=start_timeout_s)}"

    def close(self) -> None:
        self._process.kill()
        self._process.join()
