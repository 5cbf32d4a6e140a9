"""The supervisor: starts every engine instance, tells when one has failed, restarts it.

A Ray actor (threaded, no CPU reserved, on the driver's node) that owns the instances'
actors and placement groups (cluster/actors.py). Its watch thread pings every process
of every serving instance (rank 0 and the tensor-parallel ranks) each
``supervisor.heartbeat_s``; an instance has failed when any of its processes

- died (SIGKILL, OOM, a crash): its ping raises at once;
- answers no ping within ``supervisor.unresponsive_s`` (SIGSTOP, a lost host);
- has been inside one engine step for ``supervisor.step_timeout_s`` (a collective whose
  peer is gone): rank 0's ``ping`` reports how long its loop has been busy.

A router replica reports what it sees first (a feed that ended) through ``report``.
Either way, per instance and generation, once, to every router replica (docs/serving.md,
"Supervision and migration")::

    serving --failed--> router.eject (routing stops; its requests migrate)
            --> kill every process, remove the placement group
            --> start the instance again as a unit (same name, index, pool, placement)
            --> ready() answered --> router.readmit (generation + 1) --> serving

A start that fails is retried with backoff; an instance that failed
``supervisor.max_restarts`` times stays out. The supervisor never touches requests: the
router migrates them (router/placement.py).

The supervisor's own death costs no instance: they are detached (cluster/actors.py).
Ray restarts the actor (``max_restarts=-1``; the launcher's keeper, cluster/keeper.py,
kills one that hangs); the new incarnation adopts the running instances by name
(``_adopt``) with the generations the router replicas hold, restarts only those found
incomplete or mid-restart, and watches again once the routers hold every instance ready
(a router replica may itself be a new incarnation still bringing them up). Invariant:
per instance name at most one incarnation is alive, and the supervisor's generation of
it is the router's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from pdserve.cluster.actors import (
    InstanceHandles,
    kill,
    rank_names,
    remove_instance,
    start_instance,
    wait_names_free,
)
from pdserve.cluster.config import ClusterConfig, PoolConfig
from pdserve.cluster.ray_env import NAMESPACE
from pdserve.cluster.supervised import Supervised, adopt, planned, router_views
from pdserve.router.incidents import first_line

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0  # a restarted instance loading its model


class Supervisor:
    def __init__(self, config: dict, kv_secret: bytes):
        """``config``: ``ClusterConfig.to_dict()`` (checked already); ``kv_secret``: what
        the KV plane's peers prove (``cluster.launcher.kv_secret``)."""
        from pdserve.cluster.config_loader import load_config

        self.config: ClusterConfig = load_config(config)
        self.kv = {**config["kv_transfer"], "secret": kv_secret}
        self.limits = self.config.supervisor
        self.instances: dict[str, Supervised] = {}
        self.routers: list = []  # every router replica's actor handle
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        # every instance had been ready (the launcher's ``watch``, or the routers' views):
        # pinging one still loading its model would find it hung
        self._all_ready = threading.Event()
        self._restarts: list[threading.Thread] = []
        self._adopter: threading.Thread | None = None
        if _reconstructed():
            self._adopter = threading.Thread(target=self._adopt, name="adopt", daemon=True)
            self._adopter.start()

    # ---- called by the launcher ----

    def start(self) -> list[tuple[str, str, object]]:
        """Start every instance (not waiting for their models); (name, role, handle) each."""
        for role, index, pool, engine in planned(self.config):
            name = f"{role}-{index}"
            if remove_instance(name, pool.tensor_parallel):
                log.warning("instance %s: removed what a stopped cluster left of it", name)
            handles = start_instance(
                role,
                index,
                pool,
                self.config.model,
                engine,
                self._kv(pool),
                self.limits.placement_timeout_s,
                self._metrics(pool),
                self.config.router.rejoin_grace_s,
                self._peers,
            )
            self.instances[handles.name] = Supervised(role, index, pool, engine, handles)
        return [(s.name, s.role, s.handles.worker) for s in self.instances.values()]

    @property
    def _peers(self) -> bool:
        """The decode instances prefill for each other: hybrid mode without a prefill pool."""
        return self.config.mode == "hybrid" and self.config.prefill.instances == 0

    def _kv(self, pool: PoolConfig) -> dict:
        """The ``kv`` argument of a pool's workers: ``kv_transfer``'s keys, the secret, and
        where the pool's workers listen (``bind``: 127.0.0.1 by default on an embedded Ray,
        whose processes all run here) and what they advertise."""
        embedded = self.config.ray.address is None
        bind = pool.bind or ("127.0.0.1" if embedded else None)
        return {**self.kv, "bind": bind, "advertise": pool.advertise}

    def _metrics(self, pool: PoolConfig) -> dict | None:
        """The ``metrics`` argument of a pool's rank 0 (None: ``metrics_port`` unset):
        where it serves its metrics (the pool's KV interface) and the digests of the
        router's API keys, which a scrape must present one of."""
        from pdserve.router.auth import ApiKeys

        if pool.metrics_port is None:
            return None
        kv = self._kv(pool)
        keys = ApiKeys.from_config({"api_key_file": self.config.router.api_key_file})
        return {
            "bind": kv["bind"],
            "advertise": kv["advertise"],
            "port": pool.metrics_port,
            "key_digests": [d.hex() for d in keys.digests],
        }

    def watch(self, routers: list) -> None:
        """Every instance is ready: start pinging them; failures go to ``routers`` (every
        router replica)."""
        self._all_ready.set()
        self._start_watching(routers)

    def _start_watching(self, routers: list) -> None:
        """Start the watch thread (once: a restarted supervisor may have started it
        already when the launcher's ``watch`` reaches it); it pings once ``_all_ready``."""
        with self._lock:
            self.routers = list(routers)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="supervisor", daemon=True)
                self._watcher.start()

    def ping(self) -> dict:
        """Liveness for the keeper (cluster/keeper.py): this process's ``pid`` and
        ``node`` (its Ray node id); answering at all means a thread of it runs."""
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def workers(self) -> dict[str, object]:
        """Rank 0's actor handle of every instance, by name (the current incarnation)."""
        self._adopted()
        with self._lock:
            return {name: s.handles.worker for name, s in self.instances.items()}

    def roster(self) -> dict[str, dict]:
        """Each instance's current ``handle`` (rank 0's) and ``generation``, by name: what
        a restarted router replica starts from (router/server.py)."""
        self._adopted()
        with self._lock:
            return {
                name: {"handle": s.handles.worker, "generation": s.generation}
                for name, s in self.instances.items()
            }

    def handles(self, name: str) -> InstanceHandles:
        self._adopted()
        with self._lock:
            return self.instances[name].handles

    def stop(self) -> None:
        """Stop watching and restarting (a restart under way kills what it started);
        kill every instance's processes and remove their groups."""
        self._stopping.set()
        for thread in [self._adopter, self._watcher, *self._restarts]:
            if thread is not None:
                thread.join(timeout=self.limits.unresponsive_s + 5)
        with self._lock:
            instances = list(self.instances.values())
        for s in instances:
            kill(s.handles)

    # ---- a restarted supervisor ----

    def _adopt(self) -> None:
        """A restarted supervisor takes over the instances (cluster/supervised.py,
        ``adopt``): those found whole serve on; those found broken are failed and
        restarted. The watch starts now; it pings once every instance had been ready:
        the routers hold none ``starting`` (now, or later: a router replica that is itself
        a new incarnation holds them all ``starting`` until it has brought them up), or
        the launcher's ``watch`` says so (the supervisor died during the launch)."""
        views = router_views(self._routers())
        # routers that exist but give no view (one restarting, or stopped) are asked
        # again: adopting without their generations would never start the watch
        while not views and self._routers():
            log.warning("supervisor restarted: no router replica answered; asking again")
            if self._stopping.wait(self.limits.heartbeat_s):
                return
            views = router_views(self._routers())
        log.warning("supervisor restarted: adopting the instances")
        for found in adopt(self.config, views):
            if self._stopping.is_set():
                return
            s = found.supervised
            with self._lock:
                self.instances[s.name] = s
            if found.problem is not None:
                self._failed(s.name, s.generation, found.problem)
        # an instance found whole may die while the others are found: the watch's pings
        # see it (the router's report of it may have come before its record existed)
        if _none_starting(views):
            self._all_ready.set()
        self._start_watching(self._routers())

    def _adopted(self) -> None:
        """Until a restarted supervisor holds every instance again, at most
        ``supervisor.adopt_timeout_s`` (the adopter itself waits ``ROUTER_VIEW_TIMEOUT_S``
        per router replica, cluster/supervised.py); ``TimeoutError`` past it, so that no
        caller holds one of the actor's threads for longer."""
        if self._adopter is None:
            return
        self._adopter.join(timeout=self.limits.adopt_timeout_s)
        if self._adopter.is_alive():
            raise TimeoutError(
                "a restarted supervisor has not adopted the running instances within "
                f"supervisor.adopt_timeout_s={self.limits.adopt_timeout_s:g} s (it waits on "
                "each router replica's stats and on finding every instance by name)"
            )

    # ---- failures ----

    def report(self, name: str, generation: int, why: str) -> None:
        """The router saw generation ``generation`` of ``name`` fail (its feed ended). A
        restarted supervisor takes it once it holds the instances again: a report that
        came before would find no record and be lost."""
        self._adopted()
        self._failed(name, generation, why)

    def _watch(self) -> None:
        while not self._all_ready.is_set():  # a restarted supervisor: see ``_adopt``
            if self._stopping.wait(self.limits.heartbeat_s):
                return
            if _none_starting(router_views(self._routers())):
                self._all_ready.set()
        while not self._stopping.wait(self.limits.heartbeat_s):
            with self._lock:
                serving = [s for s in self.instances.values() if s.state == "serving"]
            pings = {a.ping.remote(): (s, s.generation) for s in serving for a in s.actors}
            if not pings:
                continue
            import ray

            done, late = ray.wait(
                list(pings), num_returns=len(pings), timeout=self.limits.unresponsive_s
            )
            for ref in done:
                s, generation = pings[ref]
                try:
                    busy_s = ray.get(ref)["busy_s"]
                except Exception as e:  # the process is gone
                    self._failed(s.name, generation, f"instance {s.name} failed: {first_line(e)}")
                    continue
                if busy_s > self.limits.step_timeout_s:
                    self._failed(
                        s.name,
                        generation,
                        f"instance {s.name} is stuck: one step "
                        f"has run {busy_s:.0f} s (supervisor.step_timeout_s="
                        f"{self.limits.step_timeout_s:g})",
                    )
            for ref in late:
                s, generation = pings[ref]
                self._failed(
                    s.name,
                    generation,
                    f"instance {s.name} is hung: no answer to a "
                    f"ping in {self.limits.unresponsive_s:g} s "
                    "(supervisor.unresponsive_s)",
                )

    def _failed(self, name: str, generation: int, why: str) -> None:
        with self._lock:
            s = self.instances.get(name)
            if s is None or s.generation != generation or s.state != "serving":
                return  # about an incarnation already replaced, or being replaced
            will_restart = s.restarts < self.limits.max_restarts and not self._stopping.is_set()
            s.state = "restarting" if will_restart else "failed"
        log.error("%s; %s", why, "restarting it" if will_restart else "left out")
        for router in self._routers():
            router.eject.remote(name, generation, why, will_restart)
        kill(s.handles)
        if will_restart:
            restart = threading.Thread(target=self._restart, args=(s,), name=f"restart-{name}")
            self._restarts.append(restart)
            restart.start()

    def _restart(self, s: Supervised) -> None:
        """Start ``s`` again until it is ready, then readmit it; past
        ``supervisor.max_restarts`` failed starts, leave it out and tell the router."""
        backoff = 1.0
        while not self._stopping.is_set():
            s.restarts += 1
            handles = None
            try:
                remove_instance(s.name, s.pool.tensor_parallel)  # a part left alive
                wait_names_free(rank_names(s.name, s.pool.tensor_parallel))
                handles = start_instance(
                    s.role,
                    s.index,
                    s.pool,
                    self.config.model,
                    s.engine,
                    self._kv(s.pool),
                    self.limits.placement_timeout_s,
                    self._metrics(s.pool),
                    self.config.router.rejoin_grace_s,
                    self._peers,
                )
                info = self._wait_ready(handles)
            except Exception as e:  # a start that failed (no resources yet, a crash)
                why = f"instance {s.name}: restart {s.restarts} failed: {first_line(e)}"
                log.error(why)
                if handles is not None:
                    kill(handles)
                if s.restarts >= self.limits.max_restarts:
                    with self._lock:
                        s.state = "failed"
                    for router in self._routers():
                        router.eject.remote(s.name, s.generation, why, False)
                    return
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            if info is None:  # the supervisor is stopping
                kill(handles)
                return
            with self._lock:
                s.handles, s.generation, s.state = handles, s.generation + 1, "serving"
            log.warning("instance %s: restarted (generation %d)", s.name, s.generation)
            for router in self._routers():
                router.readmit.remote(s.name, s.generation, handles.worker, info)
            return

    def _routers(self) -> list:
        """The router replicas' handles: given to ``watch``, or found by their names when
        an instance fails before that (a replica reported it)."""
        if self.routers:
            return self.routers
        import ray

        from pdserve.router.replicas import replica_name

        found = []
        for k in range(self.config.router.replicas):
            # one not started yet finds the instance failed itself
            with contextlib.suppress(ValueError):
                found.append(ray.get_actor(replica_name(k), namespace=NAMESPACE))
        return found

    def _wait_ready(self, handles: InstanceHandles) -> dict | None:
        """Its ``ready()`` facts once the model is loaded; None when the supervisor stops
        first. Raises ``TimeoutError`` past ``READY_TIMEOUT_S``, or what ``ready`` raised."""
        import ray

        ref = handles.worker.ready.remote()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._stopping.is_set():
            done, _ = ray.wait([ref], timeout=1.0)
            if done:
                return ray.get(ref)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {READY_TIMEOUT_S:g} s")
        return None


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (its process died before)."""
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's own property reads its deprecated actor_id
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.get_runtime_context().was_current_actor_reconstructed


def _none_starting(views: dict[str, dict]) -> bool:
    """The router replicas' views (``router_views``) hold every instance ready once."""
    return bool(views) and all(v["state"] != "starting" for v in views.values())
