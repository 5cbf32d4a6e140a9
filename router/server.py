"""The router as the cluster runs it: a Ray async actor that owns the router's lifecycle.

``RouterServer`` builds the core (router/core.py: admission, streams, placement,
validation, drain) and serves it through two front ends on the actor's event loop:
gRPC (router/grpc_api.py, with the ``grpc.health.v1`` service) on
``router.host:router.port`` and the OpenAI-compatible HTTP API (router/http_api.py)
on ``router.http_port``; both with the same API keys (router/auth.py), TLS
(router/tls.py) and limits (docs/serving.md, "Authentication, TLS and limits"); its
soft limit on open files raised to the hard one, one file a client connection.
cluster/launcher.py calls its methods through the actor
handle: ``start``, ``get_http_address``, ``set_peers``, ``wait_ready``, ``drain``,
``stop``, ``stats``, ``pid``, and its keeper ``ping`` (cluster/keeper.py). With
``router.replicas`` above 1 each replica is one such actor on the same ports
(router/replicas.py); the others call ``abort_here``, ``own_counts`` and
``metric_samples``.

Restarts: the actor has ``max_restarts=-1``; Ray runs ``__init__`` again in a new
process, and the launcher's keeper, seeing ``"started": False`` in ``ping``, calls
``start`` with the ports the first incarnation bound. The new incarnation connects to
every instance's feed under the same consumer name and rebuilds its streams from what
the instances still hold for it (router/rebuild.py); clients resume them by request id.

Health, on both front ends: serving while the core is (``RouterCore.serving``: every
instance loaded once, each role has a live instance, not draining); the gRPC health
status follows each flip. The cluster's supervisor calls ``eject`` and ``readmit`` as
instances fail and come back (cluster/supervisor.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource

from pdserve.router import request_log
from pdserve.router.auth import ApiKeys
from pdserve.router.core import RouterCore
from pdserve.router.grpc_api import GrpcApi
from pdserve.router.http_api import HttpApi
from pdserve.router.http_gate import HttpTimeouts
from pdserve.router.replicas import Replica

log = logging.getLogger(__name__)


class RouterServer:
    def __init__(
        self,
        model: str,
        router_config: dict,
        workers: list[tuple[str, str, object]],
        mode: str = "colocated",
        supervisor=None,
        *,
        slo: dict,
        logging_config: dict,
        replica: int = 0,
    ):
        """``workers``: (name, role, Ray actor handle) of every engine instance;
        ``supervisor``: the cluster's (told of every failure this router sees);
        ``slo``, ``logging_config``: the cluster's ``slo`` and ``logging`` sections
        (the log format and level apply to this actor's process); ``replica``: which of
        the ``router.replicas`` this one is (0 binds the ports first)."""
        from pdserve.engine.checkpoint import load_checkpoint

        request_log.configure(logging_config["format"], logging_config["level"])
        self.config = router_config
        self.model = model
        tokenizer = load_checkpoint(model).tokenizer
        self.core = RouterCore(
            router_config,
            workers,
            mode,
            tokenizer,
            supervisor,
            model_name=model,
            slo=slo,
            replica=Replica(replica, router_config["replicas"]),
        )
        self.keys = ApiKeys.from_config(router_config)
        self.address = ""  # host:port of the gRPC API
        self.http_address = ""  # host:port of the OpenAI-compatible HTTP API
        self._grpc: GrpcApi | None = None
        self._http: HttpApi | None = None
        self._ready: asyncio.Future | None = None

    async def start(
        self, port: int | None = None, http_port: int | None = None, roster: dict | None = None
    ) -> str:
        """Bind and serve (not serving until every instance is ready); the gRPC host:port.
        ``port``, ``http_port``: the ports to bind instead of the config's, and
        ``roster``: the supervisor's ``roster()`` (each instance's current handle and
        generation, by name), for a restarted incarnation (the first one's ports; an
        instance restarted since the launch)."""
        host = self.config["host"]
        port = self.config["port"] if port is None else port
        http_port = self.config["http_port"] if http_port is None else http_port
        tls = self.config["tls"]
        raise_fd_limit()
        shared = self.core.replica.count > 1  # the ports are every replica's
        grpc_api = self._grpc = GrpcApi(
            self.core,
            self.keys,
            tls,
            self.config["max_message_bytes"],
            shared,
            self.config["write_timeout_s"],
        )
        bound = await grpc_api.start(host, port)
        loop = asyncio.get_running_loop()
        self.core.on_health = lambda serving: loop.create_task(grpc_api.set_serving(serving))
        shown = host
        if host in ("0.0.0.0", "::", "[::]"):
            import ray

            shown = ray.util.get_node_ip_address()
        self.address = f"{shown}:{bound}"
        self._http = HttpApi(
            self.core,
            self.model,
            self.keys,
            tls,
            self.config["max_body_bytes"],
            shared,
            HttpTimeouts.from_config(self.config),
        )
        http_port = await self._http.start(host, http_port)
        self.http_address = f"{shown}:{http_port}"
        for inst in self.core.instances:  # a restarted incarnation: the current ones
            if roster is not None and inst.name in roster:
                inst.handle = roster[inst.name]["handle"]
                inst.generation = roster[inst.name]["generation"]
        self._ready = asyncio.get_running_loop().create_task(self._bring_up())
        return self.address

    async def get_http_address(self) -> str:
        return self.http_address

    async def set_peers(self, handles: list) -> None:
        """The other router replicas' actor handles (router/replicas.py)."""
        self.core.peers.handles = list(handles)

    async def abort_here(self, request_id: str, owner: str) -> bool:
        """Another replica was asked to abort a request it does not hold."""
        return self.core.abort(request_id, owner)

    async def own_counts(self) -> dict:
        return self.core.own_counts()

    async def metric_samples(self) -> dict:
        return self.core.metrics.samples()

    async def wait_ready(self) -> list[dict]:
        """Every instance's ``ready()`` facts, once all have loaded the model."""
        assert self._ready is not None  # start() ran: the cluster waits for it first
        return await asyncio.shield(self._ready)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, report not serving, wait for those in flight.

        Returns how many were still running at the timeout (they are aborted)."""
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

    async def ping(self) -> dict:
        """For the launcher's keeper (cluster/keeper.py): this process's ``pid`` and
        ``node``, and whether ``start`` ran in it (False: a new incarnation)."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return {"pid": os.getpid(), "node": node, "started": self._grpc is not None}

    async def pid(self) -> int:
        """This actor's process id; answering at all means its event loop runs."""
        return os.getpid()

    async def eject(self, name: str, generation: int, why: str, restarting: bool) -> None:
        """The supervisor found an instance failed: out of routing, its requests migrate."""
        self.core.eject(name, generation, why, restarting)

    async def readmit(self, name: str, generation: int, handle, info: dict) -> None:
        """The supervisor restarted an instance and it is ready: back in routing."""
        self.core.readmit(name, generation, handle, info)

    async def _bring_up(self) -> list[dict]:
        infos = await self.core.bring_up()
        log.info("router %s: %d instances ready", self.address, len(infos))
        return infos


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (every client
    connection is a file: the soft default, often 1024, is fewer than
    ``router.max_concurrent_requests``); the soft limit now. An unlimited hard limit
    is not one the kernel takes as a soft limit: the soft one is left as it is then."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft
