"""What a role adds to rank r > 0 of a tensor-parallel instance (instance/rank_actor.py):
a ``RankPart``, the rank's share of the KV transfer. A co-located instance's ranks hold
none; a prefill instance's the sending one (prefill_worker/prefill_rank.py), a decode
instance's the receiving one (decode_worker/decode_rank.py), chosen by the cluster
(cluster/actors.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the host of a part, for the checker (rank_actor.py imports this)
    from pdserve.engine.step_plan import StepPlan
    from pdserve.instance.rank_actor import RankActor


class RankPart:
    """A role's part of a ``RankActor``, made by ``RankPart(actor, kv_config)`` once the
    rank's engine is loaded and before its steps start.

    - ``around(plan)``: the ``StepHook`` of the steps that carry ``extra``
      (``RankEngine.serve``), on the rank's step thread: a per-layer callback for the
      pass and a function to call after it, each None for nothing (by default both).
    - ``calls()``: the actor calls it serves (the rank's ``expect`` and ``release``),
      each with the function that serves it; a call its rank's part does not serve is
      refused naming the rank.
    - ``ready()``: facts merged into the rank's ``ready``.

    It reaches the rank through ``name``, ``engine`` and ``leader()`` (rank 0's actor,
    to push its outcomes to) only.
    """

    def __init__(self, actor: RankActor, kv_config: dict):
        self.actor = actor

    def around(
        self, plan: StepPlan
    ) -> tuple[Callable[[int], None] | None, Callable[[], None] | None]:
        return None, None

    def calls(self) -> dict[str, Callable[..., Any]]:
        return {}

    def ready(self) -> dict:
        return {}
