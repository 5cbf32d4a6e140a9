"""``cluster.launch(config)``: engine instances and the router on Ray, and the handle
that stops them.

Each engine instance is a Ray actor named ``<role>-<index>`` (``colocated-0``) in
the namespace ``pdserve``, holding its pool's resources; it loads the model once
and limits torch to its CPU share. The supervisor (cluster/supervisor.py) starts
them, watches them and restarts one that fails; Ray restarts the supervisor when it
dies and this process's keeper (cluster/keeper.py) when it hangs, the instances serving
on meanwhile (they are detached: cluster/actors.py); the router is an async actor
(``router``) serving gRPC and HTTP, or with ``router.replicas`` N, N of them on the
same ports (``router``, ``router-1``, ...; router/replicas.py). Ray restarts a router
replica whose process dies, and its keeper in this process kills a hung one and
starts each new incarnation on the same ports (cluster/keeper.py, router/server.py). All run on the
driver's node with no CPU reserved: on an existing Ray, the head when ``pdserve up``
runs on the head's host (a driver joins the head of its host; docs/serving.md,
"Running across nodes").
Everything is checked before Ray starts; a failure while starting stops whatever had
started, detached instances included (removed by name once the supervisor stopped).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.config_loader import check_model_shape, load_config
from pdserve.cluster.ray_env import NAMESPACE, RaySession

log = logging.getLogger(__name__)


class RouterGone(RuntimeError):
    """A router actor was stopped for good: it serves the cluster's address no more."""


@dataclass
class Cluster:
    config: ClusterConfig
    session: RaySession
    supervisor: object = None  # actor handle: starts, watches and restarts the instances
    keeper: object = None  # cluster.keeper.Keeper: restarts a hung supervisor
    router_keepers: list = field(default_factory=list)  # one Keeper per router replica
    routers: list = field(default_factory=list)  # actor handles, replica 0 first
    address: str = ""  # host:port of the router's gRPC server (every replica's)
    http_address: str = ""  # host:port of its OpenAI-compatible HTTP API
    instances: list[dict] = field(default_factory=list)  # each instance's ready() facts

    def client(self):
        """A ``RouterClient`` of this router: with the first key of
        ``router.api_key_file``, and with ``router.tls`` over TLS trusting
        ``$PDSERVE_CA_FILE`` (or the system's CAs)."""
        import os

        from pdserve.router.auth import read_key_file
        from pdserve.router.client import RouterClient

        router = self.config.router
        key = read_key_file(router.api_key_file)[0] if router.api_key_file else None
        tls = router.tls.cert_file is not None
        ca = os.environ.get("PDSERVE_CA_FILE") if tls else None
        return RouterClient(self.address, api_key=key, ca_file=ca, tls=tls)

    @property
    def workers(self) -> dict:
        """Rank 0's actor handle of every instance, by name: the current incarnations
        (a restarted instance has a new one)."""
        import ray

        return ray.get(self.supervisor.workers.remote(), timeout=30)

    def handles(self, name: str):
        """``cluster.actors.InstanceHandles`` of one instance's current incarnation."""
        import ray

        return ray.get(self.supervisor.handles.remote(name), timeout=30)

    @property
    def router(self):
        """Replica 0's actor handle (None once stopped)."""
        return self.routers[0] if self.routers else None

    def stats(self) -> dict:
        """``RouterCore.stats()``, as replica 0 sums them over the replicas."""
        import ray

        return ray.get(self.router.stats.remote(), timeout=30)

    def router_pid(self, timeout_s: float = 10.0, replica: int = 0) -> int:
        """A router replica's process id (bounded); raises ``RouterGone`` once the
        actor was stopped for good (a dead process is restarted: its keeper), and
        ``GetTimeoutError`` or ``ActorUnavailableError`` (``ray.exceptions``) when it did
        not answer this time (restarting, hung)."""
        import ray

        try:
            return ray.get(self.routers[replica].pid.remote(), timeout=timeout_s)
        except ray.exceptions.ActorDiedError as e:
            who = "the router actor" if len(self.routers) == 1 else f"router replica {replica}"
            raise RouterGone(f"{who} died: {e}") from e

    def drain(self, timeout_s: float | None = None) -> int:
        """Stop taking requests and wait for those in flight, on every router replica;
        returns how many were cut."""
        import ray

        if timeout_s is None:
            timeout_s = self.config.router.drain_timeout_s
        cut = 0
        for ref in [r.drain.remote(timeout_s) for r in self.routers]:
            # a replica gone: its streams went with it
            with contextlib.suppress(ray.exceptions.ActorDiedError):
                cut += ray.get(ref, timeout=timeout_s + 30)
        return cut

    def shutdown(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Drain (optionally), then stop the router, the instances and an embedded Ray."""
        import ray

        for keeper in self.router_keepers:  # a router stopped on purpose stays stopped
            keeper.stop()
        self.router_keepers = []
        try:
            if self.routers and ray.is_initialized():
                if drain:
                    self.drain(timeout_s)
                stops = [r.stop.remote() for r in self.routers]
                for k, ref in enumerate(stops):
                    try:
                        ray.get(ref, timeout=30)
                    except Exception as e:  # stopping anyway (a replica already dead)
                        log.warning("router replica %d did not stop cleanly: %s", k, e)
        except Exception as e:  # stopping anyway
            log.warning("router did not drain cleanly: %s", e)
        finally:
            if self.keeper is not None:
                self.keeper.stop()
            if ray.is_initialized():
                for router in self.routers:
                    ray.kill(router, no_restart=True)
                if self.supervisor is not None:
                    try:
                        ray.get(self.supervisor.stop.remote(), timeout=60)
                    except Exception as e:  # its instances go with the session anyway
                        log.warning("supervisor did not stop cleanly: %s", e)
                    ray.kill(self.supervisor, no_restart=True)
                    self._remove_instances()
            self.routers, self.supervisor, self.keeper = [], None, None
            self.session.stop()

    def _remove_instances(self) -> None:
        """Whatever the supervisor did not stop (it was dead or hung), by name: the
        instances are detached, so on a Ray that outlives this process they would run
        on (the parts already stopped are gone or going: killing them again is a no-op)."""
        from pdserve.cluster.actors import remove_instance
        from pdserve.cluster.supervised import planned

        for role, index, pool, _ in planned(self.config):
            remove_instance(f"{role}-{index}", pool.tensor_parallel)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown(drain=False)


def launch(
    config: ClusterConfig | dict | str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    ready_timeout_s: float = 900.0,
) -> Cluster:
    """Start a cluster from a config (a YAML path, a dict or a ``ClusterConfig``)."""
    from pdserve.engine.checkpoint import resolve

    config = load_config(config, overrides)
    # Converts a GGUF once, here, before the instances look for it.
    check_model_shape(config, resolve(config.model))
    session = RaySession(config.ray)
    session.start()
    cluster = Cluster(config, session)
    try:
        _start(cluster, ready_timeout_s)
    except BaseException:
        cluster.shutdown(drain=False)
        raise
    return cluster


def kv_secret(secret_file: str | None) -> bytes:
    """The secret the KV plane's peers prove (docs/kv_transfer.md, "Closed by default"):
    the bytes of ``kv_transfer.secret_file``, else a new one. It reaches the workers as an
    actor argument only: never logged, never in stats."""
    from pdserve.kv_transfer.auth import MIN_SECRET_BYTES, new_secret

    if secret_file is None:
        return new_secret()
    try:
        secret = Path(secret_file).expanduser().read_bytes().strip()
    except OSError as e:
        raise ValueError(
            f"kv_transfer.secret_file={secret_file!r} cannot be read: "
            f"{e.strerror}; allowed: a readable file"
        ) from e
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"kv_transfer.secret_file={secret_file!r} holds {len(secret)} bytes; "
            f"allowed: at least {MIN_SECRET_BYTES}"
        )
    return secret


def _start(cluster: Cluster, ready_timeout_s: float) -> None:
    import ray

    from pdserve.cluster.actors import forwarded_env
    from pdserve.cluster.keeper import Keeper
    from pdserve.cluster.placement_groups import PlacementError
    from pdserve.cluster.supervisor import Supervisor
    from pdserve.router.replicas import replica_name
    from pdserve.router.server import RouterServer

    config = cluster.config
    # the router and the supervisor on the driver's node (no CPU reserved); the
    # supervisor restarts instances, so it passes PDSERVE_CPU_ISA on as the launcher does
    options = dict(namespace=NAMESPACE, num_cpus=0, **forwarded_env())
    if not str(config.ray.address or "").startswith("ray://"):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    # restarted by Ray when its process dies (the instances outlive it: it adopts them)
    cluster.supervisor = (
        ray.remote(Supervisor)
        .options(name="supervisor", max_concurrency=16, max_restarts=-1, **options)
        .remote(config.to_dict(), kv_secret(config.kv_transfer.secret_file))
    )
    try:
        specs = ray.get(cluster.supervisor.start.remote(), timeout=ready_timeout_s)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, PlacementError):  # its message, without the actor's traceback
            raise e.cause from None
        raise
    sections = config.to_dict()

    def router(replica: int, router_section: dict):
        # restarted by Ray when its process dies; its keeper starts it again (below)
        return (
            ray.remote(RouterServer)
            .options(name=replica_name(replica), max_concurrency=10_000, max_restarts=-1, **options)
            .remote(
                config.model,
                router_section,
                specs,
                config.mode,
                cluster.supervisor,
                slo=sections["slo"],
                logging_config=sections["logging"],
                replica=replica,
            )
        )

    # replica 0 binds the ports (0: any free one); the others bind the same ones
    cluster.routers = [router(0, sections["router"])]
    cluster.address = ray.get(cluster.router.start.remote(), timeout=ready_timeout_s)
    cluster.http_address = ray.get(cluster.router.get_http_address.remote())
    ports = {
        "port": int(cluster.address.rsplit(":", 1)[1]),
        "http_port": int(cluster.http_address.rsplit(":", 1)[1]),
    }
    for k in range(1, config.router.replicas):
        cluster.routers.append(router(k, {**sections["router"], **ports}))
    ray.get([r.start.remote() for r in cluster.routers[1:]], timeout=ready_timeout_s)
    ray.get(
        [r.set_peers.remote([p for p in cluster.routers if p is not r]) for r in cluster.routers]
    )
    ready = [r.wait_ready.remote() for r in cluster.routers]
    cluster.instances = ray.get(ready, timeout=ready_timeout_s)[0]
    ray.get(cluster.supervisor.watch.remote(cluster.routers))
    cluster.keeper = Keeper(cluster.supervisor, config.supervisor)
    cluster.keeper.start()
    for k, handle in enumerate(cluster.routers):
        revive = _revive(handle, cluster, ports, ready_timeout_s)
        keeper = Keeper(handle, config.router, f"router replica {k}", revive)
        cluster.router_keepers.append(keeper)
        keeper.start()


def _revive(router, cluster: Cluster, ports: dict, timeout_s: float):
    """What starts a restarted incarnation of ``router``: its servers on ``ports`` (the
    first incarnation's) with the instances as the supervisor has them now, then its
    peers (the other replicas)."""

    def revive() -> None:
        import ray

        try:
            roster = ray.get(cluster.supervisor.roster.remote(), timeout=30)
        except ray.exceptions.RayError as e:  # restarting too: the launch's instances
            log.warning("no roster from the supervisor for a restarted router: %s", e)
            roster = None
        start = router.start.remote(ports["port"], ports["http_port"], roster)
        ray.get(start, timeout=timeout_s)
        peers = [p for p in cluster.routers if p is not router]
        ray.get(router.set_peers.remote(peers), timeout=60)

    return revive
