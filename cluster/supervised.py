"""The supervisor's record of one instance (``Supervised``), the instances a config asks
for (``planned``), and finding them again when the supervisor itself was restarted
(``adopt``).

A restarted supervisor (Ray restarts its actor: cluster/supervisor.py) knows the config
and nothing else. The instances are detached named actors (cluster/actors.py), so it
finds them by name; their generations are what the router replicas hold (their
``stats``: ``state`` and ``restarts`` per instance), since a generation the routers
have not seen is one they were never told of. Invariant: an adopted instance keeps its
processes; only one with a part gone, or one the routers hold restarting (its restart
was under way), is restarted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.cluster.actors import InstanceHandles, find_instance
from pdserve.cluster.config import ClusterConfig, PoolConfig
from pdserve.router.incidents import first_line

log = logging.getLogger(__name__)

ROUTER_VIEW_TIMEOUT_S = 30.0  # a router replica's stats


@dataclass
class Supervised:
    """One instance as the supervisor keeps it; ``state``: serving, failed, restarting."""

    role: str
    index: int
    pool: PoolConfig
    engine: dict
    handles: InstanceHandles
    generation: int = 0
    state: str = "serving"
    restarts: int = 0

    @property
    def name(self) -> str:
        return self.handles.name

    @property
    def actors(self) -> list:
        return [self.handles.worker, *self.handles.ranks]


def planned(config: ClusterConfig) -> Iterator[tuple[str, int, PoolConfig, dict]]:
    """(role, index, pool, engine config) of every instance the config asks for."""
    for role, pool in config.pools().items():
        device = "cuda" if pool.resources.num_gpus > 0 else "cpu"
        engine = pool.engine_config(config.dtype, config.attention_backend, device)
        for index in range(pool.instances):
            yield role, index, pool, engine


def router_views(routers: list) -> dict[str, dict]:
    """Each instance's ``state`` and ``restarts`` (its generation) as the router replicas
    (their actor handles) see it, the entry of the highest generation; {} when no
    replica answers within ``ROUTER_VIEW_TIMEOUT_S``."""
    import ray

    views: dict[str, dict] = {}
    for router in routers:
        try:
            stats = ray.get(router.stats.remote(), timeout=ROUTER_VIEW_TIMEOUT_S)
        except Exception as e:  # a replica gone, or not started yet
            log.warning("a router replica gave no view of the instances: %s", first_line(e))
            continue
        for i in stats["instances"]:
            if i["restarts"] >= views.get(i["name"], {"restarts": -1})["restarts"]:
                views[i["name"]] = i
    return views


@dataclass
class Adopted:
    """An instance found again: ``problem`` is why it must be restarted (None: it serves
    on as it is)."""

    supervised: Supervised
    problem: str | None


def adopt(config: ClusterConfig, views: dict[str, dict]) -> Iterator[Adopted]:
    """Every planned instance as found by name, under the routers' generation (0 and
    serving where no router view has it: the routers are not up yet). One the routers
    hold failed stays failed (past ``supervisor.max_restarts``). ``restarts`` resumes
    at the generation: the failed starts of the incarnation before are not known."""
    for role, index, pool, engine in planned(config):
        name = f"{role}-{index}"
        view = views.get(name, {"state": "serving", "restarts": 0})
        try:
            handles, lookup = find_instance(name, role, pool.tensor_parallel), None
        except Exception as e:  # Ray could not say (its GCS busy): restarted to be sure
            handles, lookup = None, first_line(e)
        generation = view["restarts"]
        found = handles or InstanceHandles(name, role, None)
        s = Supervised(role, index, pool, engine, found, generation, restarts=generation)
        problem = None
        if view["state"] == "failed":
            s.state = "failed"
        elif handles is None:
            problem = f"instance {name}: a part of it is gone (found by a restarted supervisor)"
            problem += f": {lookup}" if lookup else ""
        elif view["state"] == "restarting":
            problem = f"instance {name}: its restart was under way when the supervisor died"
        yield Adopted(s, problem)
