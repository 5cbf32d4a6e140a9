"""Where an instance may run: its pool's placement constraints as a Ray placement group.

Every instance (tensor_parallel 1 too) is one STRICT_PACK placement group, one bundle
per rank, so that all its ranks share one node. A bundle holds the pool's
``resources.num_cpus``, ``resources.num_gpus`` and ``resources.custom`` (Ray custom
resources a node offers, ``ray start --resources '{"pool_prefill": 1}'``), and the
group's ``bundle_label_selector`` asks for ``node_labels`` on that node (``ray start
--labels pool=prefill``). docs/serving.md, "Running across nodes".

The group exists before any of the instance's actors (``create``), is detached like
them (it outlives the supervisor that made it: cluster/actors.py) and is removed with
them (``cluster.actors.kill``); a group that no node can hold within
``supervisor.placement_timeout_s`` is removed and the start fails with
``PlacementError`` naming the pool, what it asks for and the nodes there are.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.cluster.config import ClusterConfig, PoolConfig

RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
SHOWN_NODES = 8  # nodes a PlacementError lists


class PlacementError(RuntimeError):
    """No node could hold an instance's placement group within the bound."""


def ray_resources(v: dict[str, float]) -> str | None:
    """Ray custom resources a rank takes: names Ray does not reserve, positive amounts."""
    for name, amount in v.items():
        if not name or name in RESERVED_RESOURCES or name.startswith("node:"):
            return (
                f"{name!r} is not a custom resource name; allowed: any other non-empty name "
                f"(not {', '.join(RESERVED_RESOURCES)} or node:*; CPUs and GPUs are "
                "resources.num_cpus and resources.num_gpus)"
            )
        if not amount > 0:
            return f"{name}: {amount:g} must be > 0 (leave the name out for no constraint)"
    return None


def ray_labels(v: dict[str, str]) -> str | None:
    """Ray node labels as ``ray start --labels`` takes them: ``[prefix/]name: value``."""
    for key, value in v.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and not _LABEL_PREFIX.fullmatch(prefix)) or not _LABEL_NAME.fullmatch(name):
            return (
                f"{key!r} is not a label key; allowed: [prefix/]name, the name up to 63 "
                "letters, digits, '-', '_' or '.', starting and ending alphanumeric"
            )
        if not _LABEL_NAME.fullmatch(value):
            return (
                f"{key}: {value!r} is not a label value; allowed: up to 63 letters, digits, "
                "'-', '_' or '.', starting and ending alphanumeric"
            )
    return None


def check_placement(config: ClusterConfig) -> list[tuple[str, str]]:
    """Problems as (dotted key, message): a rank whose bundle would reserve nothing (Ray
    refuses an empty bundle), and constraints an embedded Ray can never meet (one node,
    no custom resources, no labels)."""
    problems = []
    for role, pool in config.pools().items():
        r = pool.resources
        if r.num_cpus == 0 and r.num_gpus == 0 and not r.custom:
            problems.append(
                (
                    f"{role}.resources.num_cpus",
                    "0 is not allowed with num_gpus 0 "
                    "and no resources.custom: each rank's placement-group bundle "
                    "must reserve something; allowed: > 0",
                )
            )
        if config.ray.address is not None:
            continue
        for key, asked in (("resources.custom", r.custom), ("node_labels", pool.node_labels)):
            if asked:
                problems.append(
                    (
                        f"{role}.{key}",
                        f"{asked} is not allowed with the embedded "
                        "local Ray (ray.address null): its one node has no custom "
                        "resources and no labels; allowed: {} here, or ray.address "
                        "naming a Ray cluster whose nodes offer them",
                    )
                )
    return problems


def bundle(pool: PoolConfig) -> dict[str, float]:
    """What one rank of the pool reserves on its node."""
    r = pool.resources
    cpus = {"CPU": r.num_cpus} if r.num_cpus else {}
    return {**cpus, **({"GPU": r.num_gpus} if r.num_gpus else {}), **r.custom}


def describe(role: str, pool: PoolConfig) -> str:
    """The pool's constraints in words, for errors."""
    asked = f"{pool.tensor_parallel} bundle(s) of {bundle(pool)} on one node"
    labels = f" labelled {pool.node_labels}" if pool.node_labels else ""
    return f"pool {role}: {asked}{labels} (STRICT_PACK)"


def create(name: str, role: str, pool: PoolConfig, timeout_s: float):
    """The placement group of instance ``name``, placed; raises ``PlacementError`` (the
    group removed) when no node holds it within ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    size = pool.tensor_parallel
    selector = [dict(pool.node_labels)] * size if pool.node_labels else None
    group = placement_group(
        [bundle(pool)] * size,
        strategy="STRICT_PACK",
        name=f"pdserve-{name}",
        bundle_label_selector=selector,
        lifetime="detached",
    )
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"instance {name}: no node could hold {describe(role, pool)} within "
            f"{timeout_s:g} s (supervisor.placement_timeout_s); alive nodes: {_nodes()}"
        ) from None
    return group


def _nodes() -> str:
    """The alive nodes by address: resources and labels by name (Ray's own left out)."""
    import ray

    shown = []
    alive = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])
    for node in alive[:SHOWN_NODES]:
        resources = {
            k: v
            for k, v in sorted(node["Resources"].items())
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")
        }
        labels = {
            k: v for k, v in sorted(node.get("Labels", {}).items()) if not k.startswith("ray.io/")
        }
        shown.append(f"{node['NodeManagerAddress']} {resources} labels {labels}")
    return "; ".join(shown) or "none"
