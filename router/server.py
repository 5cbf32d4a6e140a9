"""The router as the cluster runs it: a Ray async actor that owns the router's lifecycle.

``RouterServer`` builds the core (router/core.py: admission, streams, placement,
validation, drain) and serves it through two front ends on the actor's event loop:
gRPC (router/grpc_api.py, with the ``grpc.health.v1`` service) on
``router.host:router.port`` and the OpenAI-compatible HTTP API (router/http_api.py)
on ``router.http_port``. cluster/launcher.py calls its methods through the actor
handle: ``start``, ``get_http_address``, ``wait_ready``, ``drain``, ``stop``,
``stats``, ``pid``.

Health, on both front ends: not serving until every instance is ready, serving then,
not serving again from the start of a drain (HTTP also while every instance has
failed).
"""

from __future__ import annotations

import asyncio
import logging
import os

from router.core import RouterCore
from router.grpc_api import GrpcApi
from router.http_api import HttpApi

log = logging.getLogger(__name__)


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
        tokenizer = load_checkpoint(model).tokenizer
        self.core = RouterCore(router_config, workers, mode, tokenizer)
        self.address = ""  # host:port of the gRPC API
        self.http_address = ""  # host:port of the OpenAI-compatible HTTP API
        self._grpc: GrpcApi | None = None
        self._http: HttpApi | None = None
        self._ready: asyncio.Future | None = None

    async def start(self) -> str:
        """Bind and serve (not serving until every instance is ready); the gRPC host:port."""
        host, port = self.config["host"], self.config["port"]
        self._grpc = GrpcApi(self.core)
        bound = await self._grpc.start(host, port)
        shown = host
        if host in ("0.0.0.0", "::", "[::]"):
            import ray

            shown = ray.util.get_node_ip_address()
        self.address = f"{shown}:{bound}"
        self._http = HttpApi(self.core, self.model)
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
        """Refuse new requests, report not serving, wait for those in flight.

        Returns how many were still running at the timeout (they are aborted)."""
        self.core.stop_admitting()
        await self._grpc.set_serving(False)
        return await self.core.drain(timeout_s)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._http is not None:
            await self._http.stop()
        await self.core.stop()

    async def stats(self) -> dict:
        """``RouterCore.stats()``: the queue and every instance's load."""
        return await self.core.stats()

    async def pid(self) -> int:
        """This actor's process id; answering at all means its event loop runs."""
        return os.getpid()

    async def _bring_up(self) -> list[dict]:
        infos = await self.core.bring_up()
        if not self.core.draining:
            await self._grpc.set_serving(True)
        log.info("router %s: %d instances ready", self.address, len(infos))
        return infos
