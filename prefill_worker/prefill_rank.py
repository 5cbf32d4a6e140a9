"""Rank r > 0 of a tensor-parallel prefill instance: the KV sender of its share of the
heads. Each step whose prompts complete carries a ``SendList`` (``StepPlan.extra``):
this rank sends those requests' KV, layer by layer during the pass or after it, and
``acked`` gives rank 0 (``PrefillWorker``) the outcome of each transfer from here."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from engine.tp_rank import RankActor
from kv_transfer import KVDestination, get_transport
from kv_transfer.endpoints import cache_layout, kv_host
from kv_transfer.proto import kv_transfer_pb2 as kv_pb
from prefill_worker.prefill_worker import ack_timeout_s


class PrefillRank(RankActor):
    def _setup(self, kv_config: dict) -> None:
        self.layout = cache_layout(self.engine.model, self.engine.runner.blocks)
        transport = get_transport(kv_config["backend"])
        options = {"checksum": kv_config["checksum"], "name": self.name}
        if transport.name != "grpc":
            options["host"] = kv_host()
        self.sender = transport.sender(self.layout, **options)
        self.ack_timeout_s = ack_timeout_s(kv_config["lease_s"])
        self._acks: dict[str, Future] = {}
        self._acks_posted = threading.Condition()
        self._ack_pool = ThreadPoolExecutor(4, thread_name_prefix=f"{self.name}-acks")

    def acked(self, transfer_id: str) -> tuple[int, str]:
        """This rank's outcome of a transfer it sent: (bytes, error)."""
        with self._acks_posted:  # this rank's pass may still be running
            found = self._acks_posted.wait_for(
                lambda: transfer_id in self._acks, timeout=self.ack_timeout_s
            )
            future = self._acks.pop(transfer_id, None)
        if not found:
            return 0, f"{self.name}: transfer {transfer_id!r} was never sent from this rank"
        return future.result()

    def _around(self, plan):
        """The step's KV sends (StepPlan.extra): a per-layer callback and an after-pass."""
        msg = kv_pb.SendList.FromString(plan.extra)
        jobs = [
            (h.transfer_id, list(h.src_block_ids), KVDestination.from_proto(h.destination))
            for h in msg.sends
        ]
        caches = self.engine.runner.kv_caches
        errors: dict[str, str] = {}

        def send(tid, fn):
            if tid not in errors:
                try:
                    fn()
                except Exception as e:  # a broken pair: rank 0 hears it through acked
                    errors[tid] = f"{self.name}: {type(e).__name__}: {e}"

        def on_layer(layer: int) -> None:
            k, v = caches[layer]
            for tid, ids, dst in jobs:
                send(tid, lambda t=tid, i=ids, d=dst: self.sender.send_layer(t, layer, k, v, i, d))

        def after() -> None:
            kv = self.engine.runner.kv_cache
            for tid, ids, dst in jobs:
                if not msg.layerwise:
                    send(tid, lambda t=tid, i=ids, d=dst: self.sender.send_all(t, kv, i, d))
                future = self._ack_pool.submit(self._finish, tid, errors.get(tid))
                with self._acks_posted:
                    self._acks[tid] = future
                    self._acks_posted.notify_all()

        return (on_layer if msg.layerwise else None), after

    def _finish(self, transfer_id: str, error: str | None) -> tuple[int, str]:
        if error is not None:
            self.sender.abort(transfer_id)
            return 0, error
        try:
            return self.sender.finish(transfer_id, timeout=self.ack_timeout_s).bytes, ""
        except Exception as e:
            return 0, f"{self.name}: {type(e).__name__}: {e}"
