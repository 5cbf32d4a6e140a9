"""Router replicas: several router processes behind one port (docs/serving.md, "Router
replicas").

With ``router.replicas: N`` the cluster runs N router actors. Replica 0 is named
``router``, replica k ``router-k``; each binds the same gRPC and HTTP ports with
SO_REUSEPORT, so the kernel spreads incoming connections over their listeners (a
connection, with every call on it, stays with the replica that accepted it), and each
follows every instance's update feed under its own consumer name (its actor's name),
so every replica sees every instance's load and prefix cache as the instances report
them. A replica is one ``RouterCore``; this file holds what the replicas share:

- **Bounds.** A cluster-wide bound (``router.max_queue``,
  ``router.max_concurrent_requests``, ``router.max_concurrent_requests_per_key``) is
  split between the replicas (``Replica.share``): the shares sum to the bound, so the
  cluster never holds more waiting requests or calls than the config says. A share is
  at least 1 where the bound is at least 1 (a per-key bound below N grants each
  replica one).
- **An instance's room** is its ``max_batch_size`` over every replica's requests: a
  replica counts what the instance last reported holding (running and queued, whoever
  placed them) plus what it placed itself since that report (router/instances.py). A
  report comes with every frame of the replica's feed: each batch of its own updates,
  and at least every 0.5 s. Replicas placing between two reports can overshoot the
  room by those placements; the instance queues them (none is refused or lost).
- **Abort by id** reaches the replica that holds the request: a replica that does not
  hold it asks the others (``Peers.abort``). Request ids are unique per replica (a
  client-chosen id in flight on another replica is not refused as a duplicate).
- **Stats and metrics** are the cluster's, whichever replica answers: the queue
  counts and each instance's router-side counts summed over the replicas
  (``merge_stats``), the request metrics' series summed (``RouterMetrics.summed``).
  A replica that does not answer within ``PEER_TIMEOUT_S`` is left out of the sum.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import overload

from pdserve.router.incidents import first_line

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Replica:
    """Which replica this router is: ``index`` of ``count`` (``router.replicas``)."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"router replica index={self.index!r}: allowed 0..{self.count - 1}")

    @property
    def name(self) -> str:
        """The actor's name, and the consumer name on every instance's feed."""
        return replica_name(self.index)

    @overload
    def share(self, total: int) -> int: ...
    @overload
    def share(self, total: None) -> None: ...
    def share(self, total: int | None) -> int | None:
        """This replica's part of a cluster-wide bound: the parts sum to ``total`` (None:
        no bound), each at least 1 when ``total`` is."""
        if total is None or self.count == 1:
            return total
        part = total // self.count + (self.index < total % self.count)
        return max(part, min(total, 1))

    def describe(self, key: str, total: int | None) -> str:
        """A bound as a refusal names it: ``router.<key>=<total>``, and this replica's
        share where there are several."""
        text = f"router.{key}={total}"
        if self.count > 1:
            text += f", {self.share(total)} of it on router replica {self.index} of {self.count}"
        return text


def replica_name(index: int) -> str:
    return "router" if index == 0 else f"router-{index}"


class Peers:
    """The other replicas' actor handles (``RouterServer``), given once all have started;
    every call is bounded by ``PEER_TIMEOUT_S`` and a replica that does not answer is
    left out."""

    def __init__(self):
        self.handles: list = []

    async def _each(self, method: str, *args) -> list:
        async def one(handle):
            try:
                return await asyncio.wait_for(getattr(handle, method).remote(*args), PEER_TIMEOUT_S)
            except Exception as e:  # a replica gone or hung: the others still answer
                log.warning("router replica did not answer %s: %s", method, first_line(e))
                return None

        answers = await asyncio.gather(*(one(h) for h in self.handles))
        return [a for a in answers if a is not None]

    async def abort(self, request_id: str, owner: str) -> bool:
        """Whether some other replica held ``request_id`` for ``owner`` and aborted it."""
        return any(await self._each("abort_here", request_id, owner))

    async def counts(self) -> list[dict]:
        """Each answering replica's ``RouterCore.own_counts()``."""
        return await self._each("own_counts")

    async def samples(self) -> list[dict]:
        """Each answering replica's ``RouterMetrics.samples()``."""
        return await self._each("metric_samples")


def merge_stats(stats: dict, counts: list[dict]) -> dict:
    """``stats`` (this replica's ``RouterCore.stats``) with the other replicas' counts
    (``own_counts``) added: the queue, the bound, the requests in flight, and each
    instance's ``outstanding`` and ``requests_total``; draining when any replica is."""
    merged = dict(stats, instances=[dict(s) for s in stats["instances"]])
    for c in counts:
        for key in ("queued", "max_queue", "in_flight"):
            merged[key] += c[key]
        merged["draining"] = merged["draining"] or c["draining"]
        for s in merged["instances"]:
            outstanding, total = c["instances"].get(s["name"], (0, 0))
            s["outstanding"] += outstanding
            s["requests_total"] += total
    merged["replicas"] = 1 + len(counts)
    return merged
