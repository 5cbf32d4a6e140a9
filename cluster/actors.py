"""Starting one engine instance on Ray: its actor, and for tensor parallelism its other
ranks, all in one STRICT_PACK placement group (one bundle per rank, on one node, with
the pool's resources and node labels: cluster/placement_groups.py), made first.

Rank 0 is an ``EngineWorker`` holding the role's components (``role_components``),
named ``<role>-<index>``; ranks 1..N-1 are ``RankActor``s holding the role's rank part
(``role_rank_part``: none, ``PrefillRank`` or ``DecodeRank``) named
``<role>-<index>-rank<r>``, started first so that rank 0 gets their handles. They join
one torch.distributed world whose store rank 0 serves on a port picked on the group's
node, on the pool's interface (``kv["bind"]``, advertised as ``kv["advertise"]``:
``kv_transfer.protocol.endpoint``).

``PDSERVE_CPU_ISA`` (engine/native.py), when the process that starts an instance has it,
reaches every rank through the actors' ``runtime_env``: forcing the kernels' ISA where
``pdserve up`` runs forces it in the instances, on every node.

Every actor and placement group of an instance is detached (``lifetime="detached"``):
it outlives the supervisor that started it, so a supervisor that dies or hangs is
replaced while the instances keep serving, and the new one finds them by name
(``find_instance``). Detached actors outlive their job too, so every stop removes them
by name (``remove_instance``); on an embedded Ray they also end with its head, which
the ``pdserve up`` process owns (docs/serving.md, "Supervision and migration").
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field

from pdserve.cluster.config import PoolConfig
from pdserve.cluster.instance_metrics import metered
from pdserve.cluster.placement_groups import create
from pdserve.cluster.ray_env import NAMESPACE
from pdserve.instance.worker import ROLES, EngineWorker

log = logging.getLogger(__name__)

NAME_RELEASE_S = 60.0  # Ray frees a dead actor's name once its death is recorded


def forwarded_env() -> dict:
    """Actor options that pass on ``PDSERVE_CPU_ISA`` when this process has it."""
    from pdserve.engine.native import ENV

    return {"runtime_env": {"env_vars": {ENV: os.environ[ENV]}}} if os.environ.get(ENV) else {}


@dataclass
class InstanceHandles:
    name: str
    role: str
    worker: object  # rank 0's actor handle
    ranks: list = field(default_factory=list)  # ranks 1..N-1
    group: object = None  # the placement group, one bundle per rank


def role_components(role: str, peers: bool) -> tuple[type, ...]:
    """The components (instance/component.py) of a ``role`` instance's worker: none
    co-located, sending for prefill, receiving for decode, and sending too with
    ``peers`` (hybrid mode without a prefill pool: the decode instances prefill for each
    other). A pool's package loads only for a role that holds its component (both
    import torch and the KV transport; a co-located cluster's supervisor needs neither)."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: one of {list(ROLES)}")
    parts: list[type] = []
    if role == "decode":
        from pdserve.decode_worker import Receiving

        parts.append(Receiving)
    if role == "prefill" or (role == "decode" and peers):
        from pdserve.prefill_worker import Sending

        parts.append(Sending)
    return tuple(parts)


def role_rank_part(role: str) -> type | None:
    """The part (instance/rank_part.py) of a ``role`` instance's ranks 1..N-1: none
    co-located, the sender of its heads for prefill, their receiver for decode."""
    from pdserve.decode_worker import DecodeRank
    from pdserve.prefill_worker import PrefillRank

    by_role: dict[str, type | None] = {
        "colocated": None,
        "prefill": PrefillRank,
        "decode": DecodeRank,
    }
    if role not in by_role:
        raise ValueError(f"role={role!r}: one of {list(by_role)}")
    return by_role[role]


def _feed_endpoint(bind: str | None, advertise: str | None, strategy) -> dict:
    """Where rank 0's update feed listens (instance/feed.py): the pool's KV interface and
    address, resolved on the group's node when that takes the node's own address."""
    import ray

    from pdserve.kv_transfer.protocol import WILDCARDS, endpoint

    if bind is None or (advertise is None and bind in WILDCARDS):
        resolve = ray.remote(endpoint).options(num_cpus=0, scheduling_strategy=strategy)
        bind, advertise = ray.get(resolve.remote(bind, advertise))
    return {"bind": bind, "advertise": advertise or bind}


def _free_port(bind: str | None, advertise: str | None) -> tuple[str, str, int]:
    """On the group's node: (interface, advertised address, a port free on it).

    Rank 0 binds the port only once its actor is up, seconds later. Ports the kernel
    hands out (``bind(0)``, every outgoing connection) come from its ephemeral range, so
    one drawn from there could be taken by any process in that window; the port is
    drawn at random from the range between Ray's worker ports (10002-19999 by default)
    and the ephemeral one, where only an explicit bind can take it."""
    import random
    import socket
    from pathlib import Path

    from pdserve.kv_transfer.protocol import endpoint

    bind, advertise = endpoint(bind, advertise)
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for port in random.sample(range(20000, low), min(64, max(0, low - 20000))) + [0]:
        with socket.socket(family) as s:
            try:
                s.bind((bind, port))
            except OSError:
                continue
            return bind, advertise, s.getsockname()[1]
    raise OSError(f"no free port to bind on {bind}")


def start_instance(
    role: str,
    index: int,
    pool: PoolConfig,
    model: str,
    engine: dict,
    kv: dict,
    placement_timeout_s: float,
    metrics: dict | None = None,
    rejoin_grace_s: float = 0.0,
    peers: bool = False,
) -> InstanceHandles:
    """Start the instance's actors in a new placement group (``PlacementError`` when no
    node holds it within ``placement_timeout_s``); rank 0's readiness is not awaited.
    ``metrics``: None, or rank 0 serves its metrics (``cluster.instance_metrics.metered``
    and its ``metrics`` argument). ``rejoin_grace_s``: how long its update feed keeps a
    departed consumer's requests (instance/feed.py). ``peers``: a decode instance also
    prefills for its peers (``role_components``)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    name, size = f"{role}-{index}", pool.tensor_parallel
    cpus, gpus = pool.resources.num_cpus, pool.resources.num_gpus
    threads = max(1, math.floor(cpus))
    options = dict(
        namespace=NAMESPACE,
        num_cpus=cpus,
        num_gpus=gpus,
        resources=dict(pool.resources.custom),
        max_restarts=0,
        max_concurrency=8,
        lifetime="detached",
        **forwarded_env(),
    )
    parts = role_components(role, peers)
    worker_cls: type = EngineWorker
    extra: dict = {"role": role, "components": parts, "kv": kv if parts else None}
    if metrics is not None:  # rank 0 records the instance's metrics and serves them
        worker_cls, extra["metrics"] = metered(worker_cls), metrics
    worker_cls = ray.remote(worker_cls)
    group = create(name, role, pool, placement_timeout_s)

    def in_bundle(r: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)

    if size == 1:
        feed = _feed_endpoint(kv["bind"], kv["advertise"], in_bundle(0))
        extra["feed"] = {**feed, "rejoin_grace_s": rejoin_grace_s}
        handle = worker_cls.options(name=name, scheduling_strategy=in_bundle(0), **options).remote(
            name, model, engine, threads, **extra
        )
        return InstanceHandles(name, role, handle, group=group)
    bind, host, port = ray.get(
        ray.remote(_free_port)
        .options(num_cpus=0, scheduling_strategy=in_bundle(0))
        .remote(kv["bind"], kv["advertise"])
    )
    extra["feed"] = {"bind": bind, "advertise": host, "rejoin_grace_s": rejoin_grace_s}
    parallel = {"size": size, "address": f"{host}:{port}", "bind": bind, "secret": kv["secret"]}
    from pdserve.instance.rank_actor import RankActor  # torch: only with ranks 1..N-1

    part = role_rank_part(role)
    rank = {"part": part, "kv": kv if part is not None else None}
    ranks = [
        ray.remote(RankActor)
        .options(name=f"{name}-rank{r}", scheduling_strategy=in_bundle(r), **options)
        .remote(f"{name}-rank{r}", model, engine, threads, {**parallel, "rank": r}, **rank)
        for r in range(1, size)
    ]
    handle = worker_cls.options(name=name, scheduling_strategy=in_bundle(0), **options).remote(
        name, model, engine, threads, parallel={**parallel, "ranks": ranks}, **extra
    )
    return InstanceHandles(name, role, handle, ranks, group)


def rank_names(name: str, size: int) -> list[str]:
    """The actor names of instance ``name``'s ranks, rank 0 first."""
    return [name, *(f"{name}-rank{r}" for r in range(1, size))]


def find_instance(name: str, role: str, size: int) -> InstanceHandles | None:
    """The live actors and the placement group of instance ``name`` (``size`` ranks) by
    their names; None when any of them is missing (a part died, or was never started)."""
    import ray
    from ray.util import get_placement_group

    try:
        actors = [ray.get_actor(n, namespace=NAMESPACE) for n in rank_names(name, size)]
        group = get_placement_group(f"pdserve-{name}")
    except ValueError:  # no such name
        return None
    return InstanceHandles(name, role, actors[0], actors[1:], group)


def kill(handles: InstanceHandles) -> None:
    """Kill every process of the instance and remove its placement group."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in [handles.worker, *handles.ranks]:
        if actor is None:  # a part never started
            continue
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # already gone
            log.debug("kill %s: %s", handles.name, e)
    if handles.group is not None:
        try:
            remove_placement_group(handles.group)
        except Exception as e:  # already removed
            log.debug("remove group of %s: %s", handles.name, e)


def remove_instance(name: str, size: int) -> bool:
    """Kill whatever actors hold instance ``name``'s names and remove its placement group
    (each part that exists); True when anything was there."""
    import ray
    from ray.util import get_placement_group

    found = False
    for actor_name in rank_names(name, size):
        try:
            actor = ray.get_actor(actor_name, namespace=NAMESPACE)
        except ValueError:
            continue
        found = True
        kill(InstanceHandles(name, "", actor))
    try:
        group = get_placement_group(f"pdserve-{name}")
    except ValueError:
        return found
    kill(InstanceHandles(name, "", None, group=group))
    return True


def wait_names_free(names: list[str]) -> None:
    """Until no live actor holds these names (a new incarnation takes them)."""
    import ray

    deadline = time.monotonic() + NAME_RELEASE_S
    for name in names:
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"actor name {name!r} still taken after {NAME_RELEASE_S:g} s")
            time.sleep(0.1)
