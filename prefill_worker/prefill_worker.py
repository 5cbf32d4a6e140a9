"""The prefill instance: a Ray actor that prefills prompts and hands them to decode. Its
side of the handoff (docs/kv_transfer.md): sending -> acked, or failed.

    prefill(attempt) -> chunked prefill of prompt + delivered (a resumed request), FCFS
                        with other prompts under the token budget
                     -> last chunk: KV sent layer by layer during the forward pass
                        (kv_transfer.layerwise), or all layers after it   [sending]
                     -> first token sampled: the END, carrying it with the phase times,
                        to every decode rank this rank sends to
                     -> every rank of this instance heard every END answered OK: blocks
                        freed, Update(handed_off)                        [acked]
                     -> a refusal, a broken link or no answer within the ack timeout:
                        blocks freed, Update(retryable); the router redoes the request
                        on another pair                                  [failed]

Ranks 1..N-1 (``PrefillRank``) send their heads and push their own outcome here.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.llm_engine import StepFailed
from engine.messages import Attempt, Update
from engine.prefilled import Prefilled
from engine.worker import EngineWorker
from kv_transfer import Handoff, KVDestination, get_transport
from kv_transfer import kv_transfer_pb2 as kv_pb
from kv_transfer.layout import cache_layout


def ack_timeout_s(lease_s: float) -> float:
    """How long a sender waits for its ENDs' answers: past the decode lease, so that a
    transfer that stalls is reported by the decode instance, which owns the reservation,
    not by whichever side's timer fires first."""
    return 1.5 * lease_s


@dataclass(eq=False)
class Job:
    """A request in this instance: where its KV goes and how its transfer stands."""

    attempt: Attempt
    destination: KVDestination
    transfer_start: float | None = None  # wall clock, first layer handed to the transport
    send_error: str | None = None
    aborted: bool = False  # the client left while the KV was on its way
    results: dict[int, tuple[int, float, str | None]] = field(default_factory=dict)  # by rank


class PrefillWorker(EngineWorker):
    """Every request it takes hands off (engine/prefilled.py): its engine never decodes."""

    role = "prefill"

    def _setup(self, kv_config: dict) -> None:
        self.layout = cache_layout(self.engine)
        transport = get_transport(kv_config["backend"])
        self.sender = transport.sender(
            self.layout, secret=kv_config["secret"], bind=kv_config["bind"],
            advertise=kv_config["advertise"], checksum=kv_config["checksum"], name=self.name,
        )  # fmt: skip
        self.layerwise = kv_config["layerwise"]
        self.ack_timeout_s = ack_timeout_s(kv_config["lease_s"])
        self.jobs: dict[str, Job] = {}
        self._acks = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"{self.name}-acks")
        self._ops.update(prefill=self._op_prefill, acked=self._op_acked)
        self._totals["kv_bytes_total"] = 0

    def ready(self) -> dict:
        return {**super().ready(), "kv_tp_size": self.layout.tp_size}

    def prefill(self, attempt: Attempt) -> None:
        """Prefill ``attempt``'s prompt and send its KV to ``attempt.destination`` (the
        reservation of the decode instance ``attempt.decode``)."""
        self._post(("prefill", attempt))

    def rank_acked(self, transfer_id: str, rank: int, nbytes: int, error: str | None) -> None:
        """Rank ``rank``'s ENDs of a transfer were answered (or failed): pushed by it."""
        self._post(("acked", transfer_id, rank, nbytes, 0.0, error))

    def stop(self) -> None:
        super().stop()
        self._acks.shutdown(wait=False, cancel_futures=True)
        self.sender.close()

    # ---- on the step loop ----

    def _op_prefill(self, attempt: Attempt) -> list[Update]:
        if self._take_early_abort(attempt.id):
            return []
        self._consumer[attempt.id] = attempt.consumer
        try:
            dst = KVDestination.from_bytes(attempt.destination)
            self.engine.add_request(attempt.id, list(attempt.prompt_ids), attempt.params,
                                    attempt.delivered, attempt.delivered_chars,
                                    hand_off=True)  # fmt: skip
        except ValueError as e:
            return [Update(attempt.id, error=str(e))]
        self.jobs[attempt.id] = Job(attempt, dst)
        self._totals["requests_total"] += 1
        return []

    def _owns(self, request_id: str) -> bool:
        return request_id in self.jobs

    def _abort(self, request_id: str) -> list[Update]:
        if request_id in self.engine.requests:  # still prefilling: nothing was sent
            self.engine.abort_request(request_id)
            del self.jobs[request_id]
        else:  # its KV is on the way: the blocks go when the transfer ends
            self.jobs[request_id].aborted = True
        return []

    def _step(self) -> list[Update]:
        try:
            done = self.engine.step(self._plan_sends)
        except StepFailed as e:  # the request(s) that made it fail; all, had sends begun
            return self._fail(e.request_ids)
        except Exception:  # a bug outside the forward pass: every request fails
            return self._fail(list(self.engine.requests))
        self._totals["steps_total"] += 1
        return [u for p in done for u in self._hand_off(p)]

    def _fail(self, request_ids: list[str]) -> list[Update]:
        failed = super()._fail(request_ids)
        for u in failed:
            self.sender.abort(self.jobs.pop(u.request_id).attempt.id)
        return failed

    def _plan_sends(self, last):
        """For the requests in ``last`` (prompt complete in this step): the per-layer
        callback sending each finished layer (layer-wise), and the ``SendList`` that
        tells the other tensor-parallel ranks to send their heads."""
        jobs = [self.jobs[r.request_id] for r in last]
        tables = {}  # what each sends: its table past the blocks the destination holds
        for j in jobs:
            table = self.engine.blocks.block_table(j.attempt.id)
            try:
                tables[j.attempt.id] = j.destination.source_blocks(table)
            except ValueError as e:  # sends nothing (the other ranks fail on no blocks)
                tables[j.attempt.id], j.send_error = [], f"{type(e).__name__}: {e}"
        caches = self.engine.runner.kv_caches

        def on_layer(layer: int) -> None:
            # (layer, k, v), or (layer, latent row) for a latent layout
            parts = caches[layer] if self.layout.kind == "kv" else (caches[layer],)
            entry = [(layer, *parts)]
            for j in jobs:
                ids, dst = tables[j.attempt.id], j.destination
                self._send(
                    j,
                    lambda t=j.attempt.id, i=ids, d=dst: self.sender.send_layers(t, entry, i, d),
                )

        extra = b""
        if self.ranks:
            msg = kv_pb.SendList(layerwise=self.layerwise)
            for j in jobs:
                send = msg.sends.add(transfer_id=j.attempt.id, src_block_ids=tables[j.attempt.id])
                j.destination.to_proto(send.destination)
            extra = msg.SerializeToString()
        return (on_layer if self.layerwise else None), extra

    def _send(self, job: Job, send) -> None:
        if job.send_error is not None:
            return
        job.transfer_start = job.transfer_start or time.time()
        try:
            send()
        except Exception as e:  # a broken pair, a layout mismatch: the request is redone
            job.send_error = f"{type(e).__name__}: {e}"

    def _hand_off(self, p: Prefilled) -> list[Update]:
        job = self.jobs[p.request.request_id]
        tid = job.attempt.id
        if p.error is not None:
            del self.jobs[tid]
            return [Update(tid, error=p.error, retryable=True)]
        if not self.layerwise:
            kv, dst = self.engine.runner.kv_cache, job.destination
            self._send(job, lambda: self.sender.send_all(tid, kv, dst.source_blocks(p.block_ids),
                                                         dst))  # fmt: skip
        times = {**p.times, "transfer_start": job.transfer_start or time.time()}
        lp = p.logprobs  # the first token's, when the request asked
        first = () if lp is None else (lp.logprob, lp.top_ids, lp.top_logprobs)
        handoff = Handoff(p.first_token, times, self.name, *first, cached_tokens=p.cached_tokens)
        self._acks.submit(self._finish, job, handoff)
        return []

    def _finish(self, job: Job, handoff: Handoff) -> None:
        """On an ack thread: END the transfer (unless a send failed) and wait for every
        answer, then report to the loop."""
        tid, nbytes, seconds, error = job.attempt.id, 0, 0.0, job.send_error
        if error is None:
            try:
                ack = self.sender.finish(tid, handoff, timeout=self.ack_timeout_s)
                nbytes, seconds = ack.bytes, ack.seconds
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        else:
            self.sender.abort(tid)
        self._post(("acked", tid, 0, nbytes, seconds, error))

    def _op_acked(self, tid: str, rank: int, nbytes: int, seconds: float, error: str | None):
        job = self.jobs.get(tid)
        if job is None:
            return []
        job.results[rank] = (nbytes, seconds, error)
        if len(job.results) < 1 + len(self.ranks):
            return []
        self.engine.release(tid)
        del self.jobs[tid]
        if job.aborted:
            return []
        errors = [e for _, _, e in job.results.values() if e is not None]
        if errors:
            why = f"KV transfer {tid!r} {self.name} -> {job.attempt.decode} failed: {errors[0]}"
            return [Update(tid, error=why, retryable=True)]
        total = sum(n for n, _, _ in job.results.values())
        self._totals["kv_bytes_total"] += total
        info = {"kv_bytes": total, "transfer_s": job.results[0][1]}
        return [Update(tid, handed_off=True, info=info)]

    def _stats(self) -> dict:
        stats = super()._stats()
        stats["in_transfer"] = len(self.jobs) - len(self.engine.requests)
        return stats
