"""The part (instance/rank_part.py) of rank r > 0 of a tensor-parallel prefill instance:
the KV sender of its share of the
heads. Each step whose prompts complete carries a ``SendList`` (``StepPlan.extra``):
this rank sends those requests' KV, layer by layer during the pass or after it, ends
each transfer (an END without a handoff: source rank 0's carries it) and pushes the
outcome to rank 0 (its worker's ``rank_acked``: ``Sending``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from pdserve.instance.rank_part import RankPart
from pdserve.kv_transfer import KVDestination, backend_options, get_transport
from pdserve.kv_transfer import kv_transfer_pb2 as kv_pb
from pdserve.kv_transfer.layout import cache_layout
from pdserve.prefill_worker.sending import ack_timeout_s

if TYPE_CHECKING:
    from pdserve.engine.step_plan import StepPlan
    from pdserve.instance.rank_actor import RankActor


class PrefillRank(RankPart):
    def __init__(self, actor: RankActor, kv_config: dict):
        super().__init__(actor, kv_config)
        self.name, self.engine = actor.name, actor.engine
        self.layout = cache_layout(self.engine)
        transport = get_transport(kv_config["backend"])
        self.sender = transport.sender(
            self.layout,
            secret=kv_config["secret"],
            bind=kv_config["bind"],
            advertise=kv_config["advertise"],
            **backend_options(kv_config),
            checksum=kv_config["checksum"],
            name=self.name.rsplit("-rank", 1)[0],  # the instance: what decode expects
        )
        self.ack_timeout_s = ack_timeout_s(kv_config["lease_s"])
        self._acks = ThreadPoolExecutor(4, thread_name_prefix=f"{self.name}-acks")

    def around(self, plan: StepPlan):
        """The step's KV sends (StepPlan.extra): a per-layer callback and an after-pass."""
        msg = kv_pb.SendList.FromString(plan.extra)
        jobs = [
            (s.transfer_id, list(s.src_block_ids), KVDestination.from_proto(s.destination))
            for s in msg.sends
        ]
        caches = self.engine.kv_view().layers
        errors: dict[str, str] = {}

        def send(tid, fn):
            if tid not in errors:
                try:
                    fn()
                except Exception as e:  # a broken pair: reported to rank 0 with the outcome
                    errors[tid] = f"{self.name}: {type(e).__name__}: {e}"

        def on_layer(layer: int) -> None:
            # (layer, k, v), or (layer, latent row) for a latent layout
            parts = caches[layer] if self.layout.kind == "kv" else (caches[layer],)
            entry = [(layer, *parts)]
            for tid, ids, dst in jobs:
                send(tid, lambda t=tid, i=ids, d=dst: self.sender.send_layers(t, entry, i, d))

        def after() -> None:
            kv = self.engine.kv_view().cache
            for tid, ids, dst in jobs:
                if not msg.layerwise:
                    send(tid, lambda t=tid, i=ids, d=dst: self.sender.send_all(t, kv, i, d))
                self._acks.submit(self._finish, tid, errors.get(tid))

        return (on_layer if msg.layerwise else None), after

    def _finish(self, transfer_id: str, error: str | None) -> None:
        nbytes = 0
        if error is not None:
            self.sender.abort(transfer_id)
        else:
            try:
                nbytes = self.sender.finish(transfer_id, timeout=self.ack_timeout_s).bytes
            except Exception as e:
                error = f"{self.name}: {type(e).__name__}: {e}"
        self.actor.leader().rank_acked.remote(transfer_id, self.layout.tp_rank, nbytes, error)
