"""Ranks 1..N-1 of a tensor-parallel engine instance, as Ray actors.

Rank 0 is the instance's worker (``EngineWorker``, ``DecodeWorker`` or
``PrefillWorker``): it schedules, broadcasts each step, talks to the router and calls
these actors for their part of the KV transfer. A ``RankWorker`` runs the broadcast
forward passes on a thread of its own (``RankEngine.serve``) and, by role:

* decode: a KV receiver for its shard of the cache; rank 0 calls ``expect`` when it
  reserves, ``collect`` to learn which transfers have landed here, ``cancel``;
* prefill: a KV sender; the step's ``SendList`` (``StepPlan.extra``) says which
  requests' KV to send, layer by layer during the pass or after it, and ``acked``
  gives rank 0 the outcome of each transfer from this rank.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from decode_worker.kv_setup import cache_layout, kv_host
from engine import EngineConfig
from engine.parallel import TensorParallel
from engine.tp_rank import RankEngine
from kv_transfer import KVDestination, KVTransferError, get_transport
from kv_transfer.proto import kv_transfer_pb2 as kv_pb


class RankWorker:
    def __init__(
        self,
        name: str,
        model: str,
        engine_config: dict,
        num_threads: int,
        role: str,
        kv_config: dict | None,
        parallel: dict,
    ):
        torch.set_num_threads(max(1, num_threads))
        self.name, self.role = name, role
        config = EngineConfig(**engine_config)
        tp = TensorParallel.join(
            parallel["address"], parallel["rank"], parallel["size"], config.device
        )
        self.engine = RankEngine(model, config, tp)
        self.layout = cache_layout(self.engine.model, self.engine.runner.blocks)
        self.receiver = self.sender = None
        if role == "decode":
            transport = get_transport(kv_config["backend"])
            self.receiver = transport.receiver(
                self.layout, self.engine.runner.kv_cache, host=kv_host()
            )
        elif role == "prefill":
            transport = get_transport(kv_config["backend"])
            options = {"checksum": kv_config["checksum"], "name": name}
            if transport.name != "grpc":
                options["host"] = kv_host()
            self.sender = transport.sender(self.layout, **options)
            self.ack_timeout_s = kv_config["lease_s"]
            self._acks: dict[str, Future] = {}
            self._acks_posted = threading.Condition()
            self._ack_pool = ThreadPoolExecutor(4, thread_name_prefix=f"{name}-acks")
        around = self._sends if role == "prefill" else None
        self._loop = threading.Thread(
            target=self.engine.serve, args=(around,), name=f"{name}-steps", daemon=True
        )
        self._loop.start()

    def ready(self) -> dict:
        return {"name": self.name, "kv_address": self.receiver.address if self.receiver else ""}

    # ---- decode ----

    def expect(self, transfer_id: str, block_ids: list[int], src_tp: int, lease_s: float):
        src = replace(self.layout, tp_size=src_tp, tp_rank=0)
        self.receiver.expect(transfer_id, block_ids, src, lease_s)

    def collect(self, transfer_ids: list[str]) -> dict[str, tuple[int, str]]:
        """The transfers that have landed (or failed) on this rank: (bytes, error)."""
        out = {}
        for tid in transfer_ids:
            if tid in self.receiver.pending() and self.receiver.ready(tid):
                try:
                    out[tid] = (self.receiver.wait(tid, timeout=0).bytes, "")
                except KVTransferError as e:
                    out[tid] = (0, f"{self.name}: {e}")
        return out

    def cancel(self, transfer_ids: list[str]) -> None:
        for tid in transfer_ids:
            self.receiver.cancel(tid)

    # ---- prefill ----

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

    def _sends(self, plan):
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
