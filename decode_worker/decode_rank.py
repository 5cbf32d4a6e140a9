"""The part (instance/rank_part.py) of rank r > 0 of a tensor-parallel decode instance:
the KV receiver of its share of the heads. Rank 0 (its worker's ``Receiving``) has it
``expect`` each reservation (without a lease: rank 0's covers the instance) and
``release`` it; this rank pushes each transfer's outcome on its share to rank 0 (its
worker's ``rank_landed``) as it happens. A replicated
latent (MLA) is never expected here: it lands on rank 0 alone, which copies it into this
rank's cache between two steps (``StepPlan.copy_blocks``, received by ``serve``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pdserve.instance.rank_part import RankPart
from pdserve.kv_transfer import Outcome, backend_options, get_transport
from pdserve.kv_transfer.layout import cache_layout

if TYPE_CHECKING:
    from pdserve.instance.rank_actor import RankActor


class DecodeRank(RankPart):
    """The rank's ``expect`` and ``release`` calls; no step hook (its steps send nothing)."""

    def __init__(self, actor: RankActor, kv_config: dict):
        super().__init__(actor, kv_config)
        self.name, self.engine = actor.name, actor.engine
        self.layout = cache_layout(self.engine)
        self.receiver = get_transport(kv_config["backend"]).receiver(
            self.layout,
            self.engine.kv_view().cache,
            secret=kv_config["secret"],
            bind=kv_config["bind"],
            advertise=kv_config["advertise"],
            **backend_options(kv_config),
        )
        self.receiver.on_event = self._report

    def calls(self) -> dict[str, Callable[..., Any]]:
        return {"expect": self.expect, "release": self.release}

    def ready(self) -> dict:
        return {"kv_address": self.receiver.address}

    def expect(
        self,
        transfer_id: str,
        block_ids: list[int],
        src_tp: int,
        token: str,
        sender: str,
        layer_skip: list[int],
    ) -> None:
        """Expect rank 0's reservation, named on the wire by rank 0's ``token``, from the
        prefill instance ``sender``, each layer's blocks from ``layer_skip`` on."""
        src = replace(self.layout, tp_size=src_tp, tp_rank=0)
        self.receiver.expect(
            transfer_id, block_ids, src, token=token, sender=sender, layer_skip=layer_skip
        )

    def release(self, transfer_id: str) -> None:
        self.receiver.release(transfer_id)

    def _report(self, outcome: Outcome) -> None:
        error = None if outcome.error is None else f"{self.name}: {outcome.error}"
        self.actor.leader().rank_landed.remote(
            outcome.transfer_id, self.layout.tp_rank, outcome.bytes, error
        )
