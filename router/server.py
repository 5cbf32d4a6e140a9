"""The router: an asyncio gRPC server in front of the engine instances.

``RouterServer`` is the control plane: it owns the admission queue, the routing
policy, the instances' loads and the health status, and serves the ``Router``
gRPC service (router/service.py) plus the standard ``grpc.health.v1`` service. The
cluster runs it as a Ray async actor, so its methods and the gRPC server share
the actor's event loop; it reaches the engine instances only through their Ray
handles.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router import pdserve_pb2 as pb
from router import pdserve_pb2_grpc as pb_grpc
from router.admission import AdmissionQueue
from router.disagg import Disaggregated
from router.instances import Instance
from router.placement import Colocated
from router.policies import make_policy
from router.stream import Delta, RequestStream
from router.validation import InvalidRequest, ModelLimits, RequestValidator

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Router"].full_name  # pdserve.v1.Router
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Refused(Exception):
    """A request the router will not take: the gRPC status and why (the HTTP API maps
    the status to its own)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class RouterServer:
    def __init__(
        self,
        model: str,
        router_config: dict,
        workers: list[tuple[str, str, object]],
        mode: str = "colocated",
    ):
        """``workers``: (name, role, Ray actor handle) of every engine instance."""
        from engine.checkpoint import load_checkpoint

        self.config = router_config
        self.model = model
        self.tokenizer = load_checkpoint(model).tokenizer
        self.instances = [Instance(n, r, h, i) for i, (n, r, h) in enumerate(workers)]
        self.admission: AdmissionQueue[RequestStream] = AdmissionQueue(router_config["max_queue"])
        placement = Disaggregated if mode == "disaggregated" else Colocated
        self.placement = placement(self, self.instances, make_policy(router_config["policy"]))
        self.streams: dict[str, RequestStream] = {}  # in flight: queued or sent
        self.validator: RequestValidator | None = None
        self.draining = False
        self.address = ""
        self.http_address = ""  # host:port of the OpenAI-compatible HTTP API
        self._http = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._ready: asyncio.Future | None = None

    # ---- lifecycle (called through the actor handle) ----

    async def start(self) -> str:
        """Bind and serve (NOT_SERVING until every instance is ready); returns host:port."""
        from router.service import RouterService

        host, port = self.config["host"], self.config["port"]
        self._server = grpc.aio.server()
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        pb_grpc.add_RouterServicer_to_server(RouterService(self), self._server)
        await self._set_health(_NOT_SERVING)
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise RuntimeError(
                f"router.port={port}: cannot bind {host}:{port} ({e}); is it in use?"
            ) from e
        await self._server.start()
        shown = host
        if host in ("0.0.0.0", "::", "[::]"):
            import ray

            shown = ray.util.get_node_ip_address()
        self.address = f"{shown}:{bound}"
        from router.http_api import HttpApi

        self._http = HttpApi(self, self.model)
        http_port = await self._http.start(host, self.config["http_port"])
        self.http_address = f"{shown}:{http_port}"
        self._ready = asyncio.get_running_loop().create_task(self._bring_up())
        return self.address

    async def get_http_address(self) -> str:
        return self.http_address

    async def wait_ready(self) -> list[dict]:
        """Every instance's ``ready()`` facts, once all have loaded the model."""
        return await asyncio.shield(self._ready)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, report NOT_SERVING, wait for those in flight.

        Returns how many were still running at the timeout (they are aborted)."""
        self.draining = True
        await self._set_health(_NOT_SERVING)
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = list(self.streams.values())
        for stream in left:
            self.cancel(stream, "abort")
        return len(left)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._http is not None:
            await self._http.stop()
        for inst in self.instances:
            await inst.stop_polling()

    async def stats(self) -> dict:
        per = await asyncio.gather(*(i.stats() for i in self.instances), return_exceptions=True)
        instances = []
        for inst, s in zip(self.instances, per, strict=True):
            s = s if isinstance(s, dict) else {"name": inst.name, "dead": str(s)}
            s.update(role=inst.role, outstanding=inst.load.outstanding)
            s["requests_total"] = inst.requests_total
            instances.append(s)
        return {
            "queued": len(self.admission),
            "max_queue": self.admission.max_size,
            "in_flight": len(self.streams),
            "draining": self.draining,
            "instances": instances,
        }

    # ---- control plane (called by the gRPC service, on this event loop) ----

    @property
    def ready(self) -> bool:
        return self.validator is not None

    def open_stream(self, request: pb.GenerateRequest, arrival: float) -> RequestStream:
        """Validate, tokenize and admit a ``GenerateRequest`` (from gRPC or HTTP): its
        stream, placed or queued; raises ``Refused``."""
        if self.draining:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the router is draining")
        if not self.ready:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the instances are still loading")
        if not self.alive:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "every engine instance has failed")
        try:
            prompt_ids = self.validator.prompt_ids(request)
            params = self.validator.sampling(request)
        except InvalidRequest as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.streams:
            raise Refused(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id={request_id!r}: already in flight"
            )
        stream = RequestStream(request_id, prompt_ids, params, arrival=arrival)
        if not self.admit(stream):
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"admission queue full: {self.admission.max_size} requests are waiting "
                "for an instance (router.max_queue); retry later",
            )
        return stream

    def admit(self, stream: RequestStream) -> bool:
        """Place the request now, or queue it; False when the queue is full."""
        if not self.admission and self.placement.can_place(stream):
            self.streams[stream.request_id] = stream
            self.placement.place(stream)
            return True
        if not self.admission.offer(stream):
            return False
        self.streams[stream.request_id] = stream
        self._dispatch()
        return True

    def requeue(self, stream: RequestStream) -> None:
        """An admitted request the placement could not start after all: it goes back to
        the head of the queue (whatever the bound) and waits for room."""
        if stream.finished or self.streams.get(stream.request_id) is not stream:
            return
        self.admission.push_front(stream)
        asyncio.get_running_loop().call_soon(self._dispatch)

    def after_updates(self, ended: list[RequestStream]) -> None:
        """Requests ended (finished or failed): forget them; room for waiting ones."""
        for stream in ended:
            if self.streams.get(stream.request_id) is stream:
                del self.streams[stream.request_id]
        self._dispatch()

    def cancel(self, stream: RequestStream, reason: str | None = None) -> bool:
        """Take a request out of the router and its instances (frees its KV blocks).

        With ``reason``, the stream's client is told it finished that way."""
        if self.streams.pop(stream.request_id, None) is None:
            return False
        if not self.admission.remove(stream):
            self.placement.cancel(stream)
        if reason is not None:
            stream.deliver(Delta([], "", reason))
        stream.finished = True
        self._dispatch()
        return True

    def finish(self, stream: RequestStream) -> None:
        """The stream ended (finished, failed, or its client went away)."""
        if not stream.finished or stream.request_id in self.streams:
            self.cancel(stream)

    @property
    def alive(self) -> bool:
        return self.placement.alive

    def _dispatch(self) -> None:
        """Start waiting requests, oldest first, while the placement has room."""
        if not self.alive:  # nothing will ever take them
            for stream in self.admission.drain():
                self.streams.pop(stream.request_id, None)
                stream.deliver(Delta([], "", "error", "the engine instances have failed"))
            return
        while self.admission and self.placement.can_place(self.admission.peek()):
            self.placement.place(self.admission.pop())

    def _on_updates(self, inst: Instance, updates: list) -> None:
        self.after_updates(self.placement.on_updates(inst, updates))

    def _on_dead(self, inst: Instance) -> None:
        self.after_updates(self.placement.on_dead(inst))

    async def _bring_up(self) -> list[dict]:
        infos = await asyncio.gather(*(i.wait_ready() for i in self.instances))
        self.validator = RequestValidator(
            self.tokenizer,
            ModelLimits(
                max_context=min(i["max_context"] for i in infos),
                vocab_size=min(i["vocab_size"] for i in infos),
                kv_tokens=min(i["num_blocks"] * i["block_size"] for i in infos),
            ),
        )
        for inst in self.instances:
            inst.start_polling(self._on_updates, self._on_dead)
        if not self.draining:
            await self._set_health(_SERVING)
        log.info("router %s: %d instances ready", self.address, len(infos))
        return infos

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)
