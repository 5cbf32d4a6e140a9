"""The decode instance: a Ray actor that reserves blocks, receives KV into them, and
decodes.

Per request (router/disagg.py):

    reserve(...)  blocks for the prompt, expected by the KV receiver under a lease;
                  returns the KVDestination the prefill instance sends to (None: no room)
    admit(...)    the KVHandoff from the prefill instance (prompt, first token, times)
    last layer landed -> the request joins the running batch; its first token and then
                  one token per step stream to the router
    lease over before the last layer -> reservation released, Update(retryable)

State of one reservation:

    reserved --admit--> handed off --KV complete--> running (engine) --> finished
        \\______________________\\___lease expired / transfer failed / abort--> released
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from engine import SamplingParams
from engine.updates import Update
from engine.worker import EngineWorker
from kv_transfer import KVDestination, KVHandoff, KVTransferError, get_transport
from kv_transfer.endpoints import cache_layout, kv_host

LEASE_CHECK_S = 0.05  # how often an idle loop with reservations looks at their leases
ARRIVAL_CHECK_S = 0.002  # ... and at handoffs whose last layer is on its way


@dataclass(eq=False)
class Reservation:
    request_id: str
    transfer_id: str
    params: dict
    deadline: float  # time.monotonic(): released when the KV is not complete by then
    reserved_at: float = field(default_factory=time.time)
    handoff: KVHandoff | None = None
    rank_results: dict[int, tuple[int, str]] = field(default_factory=dict)  # other ranks


class DecodeWorker(EngineWorker):
    role = "decode"

    def _setup(self, kv_config: dict) -> None:
        self.layout = cache_layout(self.engine.model, self.engine.blocks)
        self.transport = get_transport(kv_config["backend"])
        self.receiver = self.transport.receiver(
            self.layout, self.engine.runner.kv_cache, host=kv_host()
        )
        self.lease_s = kv_config["lease_s"]
        self.reservations: dict[str, Reservation] = {}
        self._by_transfer: dict[str, str] = {}  # transfer id -> request id
        self._next_lease_check = 0.0
        self.addresses = [self.receiver.address]  # one KV receiver per tensor-parallel rank
        if self.ranks:
            import ray

            self.addresses += [
                i["kv_address"] for i in ray.get([r.ready.remote() for r in self.ranks])
            ]
        self._totals.update(kv_bytes_total=0, leases_expired_total=0)

    def ready(self) -> dict:
        return {**super().ready(), "kv_addresses": self.addresses}

    def reserve(
        self,
        request_id: str,
        transfer_id: str,
        num_prompt_tokens: int,
        params: dict,
        src_tp_size: int,
        consumer: str,
    ) -> bytes | None:
        """Hold blocks for a prompt's KV; the ``KVDestination`` (protobuf bytes) to send it
        to, or None when this instance has no room (batch full or too few free blocks)."""
        return self.on_loop(
            self._reserve, request_id, transfer_id, num_prompt_tokens, params, src_tp_size, consumer
        )

    def admit(self, handoff: bytes) -> None:
        """The prefill instance's ``KVHandoff`` (protobuf bytes) for a reservation."""
        self._post(("handoff", KVHandoff.from_bytes(handoff)))

    def stop(self) -> None:
        super().stop()
        self.receiver.close()

    # ---- on the step loop ----

    def _reserve(self, request_id, transfer_id, num_prompt_tokens, params, src_tp_size, consumer):
        if self._take_early_abort(request_id):
            return None
        e = self.engine
        busy = len(self.reservations) + len(e.scheduler.running) + len(e.scheduler.waiting)
        # room for the prompt and the first decoded token
        if busy >= e.config.max_batch_size or not e.blocks.can_allocate(
            request_id, num_prompt_tokens + 1
        ):
            return None
        if request_id in self.reservations or request_id in e.requests:
            raise ValueError(f"request_id={request_id!r}: already in use on {self.name}")
        block_ids = e.blocks.allocate(request_id, num_prompt_tokens)
        src = replace(self.layout, tp_size=src_tp_size, tp_rank=0)
        self.receiver.expect(transfer_id, block_ids, src, self.lease_s)
        if self.ranks:
            import ray

            ray.get([
                r.expect.remote(transfer_id, block_ids, src_tp_size, self.lease_s)
                for r in self.ranks
            ])  # fmt: skip
        self.reservations[request_id] = Reservation(
            request_id, transfer_id, params, time.monotonic() + self.lease_s
        )
        self._by_transfer[transfer_id] = request_id
        self._consumer[request_id] = consumer
        dst = KVDestination(self.addresses, block_ids, self.layout, self.transport.name)
        return dst.to_proto().SerializeToString()

    def _op_handoff(self, handoff: KVHandoff) -> list[Update]:
        r = self.reservations.get(handoff.request_id)
        if r is not None and r.transfer_id == handoff.transfer_id:
            r.handoff = handoff
        return []  # otherwise: a handoff for a released reservation

    def _idle_wait_s(self) -> float | None:
        if any(r.handoff is not None for r in self.reservations.values()):
            return ARRIVAL_CHECK_S
        return LEASE_CHECK_S if self.reservations else None

    def _between_steps(self) -> list[Update]:
        """Admit handed-off requests whose KV has landed; every LEASE_CHECK_S, release
        reservations whose lease ran out. Free when nothing is reserved (most decode
        steps)."""
        if not self.reservations:
            return []
        out = []
        for r in list(self.reservations.values()):
            if r.handoff is not None and self.receiver.ready(r.transfer_id) and self._ranks_done(r):
                out += self._start_decoding(r)
        now = time.monotonic()
        if now < self._next_lease_check:
            return out
        self._next_lease_check = now + LEASE_CHECK_S
        for tid in self.receiver.reap_expired():
            if tid in self._by_transfer:
                out += self._lease_over(self.reservations[self._by_transfer[tid]])
        for r in list(self.reservations.values()):
            if now > r.deadline + self.lease_s:  # complete, but no handoff ever came
                self.receiver.cancel(r.transfer_id)
                out += self._lease_over(r)
        return out

    def _ranks_done(self, r: Reservation) -> bool:
        """Whether the transfer has landed (or failed) on every other rank too."""
        missing = [i for i in range(len(self.ranks)) if i not in r.rank_results]
        if missing:
            import ray

            found = ray.get([self.ranks[i].collect.remote([r.transfer_id]) for i in missing])
            for i, got in zip(missing, found, strict=True):
                if r.transfer_id in got:
                    r.rank_results[i] = tuple(got[r.transfer_id])
        return len(r.rank_results) == len(self.ranks)

    def _start_decoding(self, r: Reservation) -> list[Update]:
        self._drop(r)
        try:
            stats = self.receiver.wait(r.transfer_id, timeout=0)
            error = next((e for _, e in r.rank_results.values() if e), None)
            if error is not None:
                raise KVTransferError(error)
        except KVTransferError as e:
            self.engine.blocks.free(r.request_id)
            return [Update(r.request_id, error=str(e), retryable=True)]
        kv_bytes = stats.bytes + sum(b for b, _ in r.rank_results.values())
        h = r.handoff
        times = {**h.phase_times, "reserved": r.reserved_at, "transfer_end": time.time()}
        try:
            out = self.engine.add_prefilled(
                r.request_id,
                list(h.prompt_token_ids),
                h.first_token,
                SamplingParams(**r.params),
                h.sampler_state,
            )
        except ValueError as e:
            self.engine.blocks.free(r.request_id)
            return [Update(r.request_id, error=str(e))]
        times["decode_start"] = time.time()
        self._totals["requests_total"] += 1
        self._totals["kv_bytes_total"] += kv_bytes
        self._totals["tokens_total"] += 1
        info = {
            "phases": times,
            "kv_bytes": kv_bytes,
            "transfer_s": stats.seconds,
            "prefill_instance": h.prefill_instance,
        }
        return [
            Update(
                r.request_id,
                out.new_token_ids,
                out.new_text,
                out.finish_reason,
                info=info,
            )
        ]

    def _lease_over(self, r: Reservation) -> list[Update]:
        self._drop(r)
        self.engine.blocks.free(r.request_id)
        self._totals["leases_expired_total"] += 1
        why = (
            f"KV transfer {r.transfer_id!r} to {self.name} did not complete within "
            f"kv_transfer.lease_s={self.lease_s:g}s; its reservation was released"
        )
        return [Update(r.request_id, error=why, retryable=True)]

    def _drop(self, r: Reservation) -> None:
        del self.reservations[r.request_id]
        self._by_transfer.pop(r.transfer_id, None)
        for rank in self.ranks:
            rank.cancel.remote([r.transfer_id])

    def _owns(self, request_id: str) -> bool:
        return request_id in self.reservations or super()._owns(request_id)

    def _abort(self, request_id: str) -> list[Update]:
        r = self.reservations.get(request_id)
        if r is None:
            return super()._abort(request_id)
        self._drop(r)
        self.receiver.cancel(r.transfer_id)
        self.engine.blocks.free(request_id)
        return []

    def _stats(self) -> dict:
        stats = super()._stats()
        stats["reserved"] = len(self.reservations)
        return stats
