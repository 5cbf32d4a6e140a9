"""Workers of each role made as the cluster makes them (cluster/actors.py
``role_components``), for the tests that drive them in-process, and their parts."""

from __future__ import annotations

from typing import TypeVar

from pdserve.cluster.actors import role_components
from pdserve.instance.component import Component
from pdserve.instance.worker import EngineWorker

C = TypeVar("C", bound=Component)


def worker(
    role: str,
    name: str,
    model: str,
    config: dict,
    threads: int,
    kv: dict | None = None,
    peers: bool = False,
    **options,
) -> EngineWorker:
    """A ``role`` instance's worker; ``peers``: a decode instance that prefills for peers."""
    parts = role_components(role, peers)
    return EngineWorker(name, model, config, threads, role=role, components=parts, kv=kv, **options)


def part(w: EngineWorker, kind: type[C]) -> C:
    """``w``'s component of type ``kind`` (the receiving one's receiver, layout, ...)."""
    found = [c for c in w.components if isinstance(c, kind)]
    assert len(found) == 1, (w.name, kind.__name__, w.components)
    return found[0]
