"""The sending component (instance/component.py): the prefilling instance's side of
handoffs (docs/kv_transfer.md), the requests whose prompt this instance computes for
another instance to decode, and their transfers. A prefill instance holds it and hands
off every request it takes; a decode instance in hybrid mode without a prefill pool
holds it too and hands off the prompts it computes for a peer (docs/serving.md, "Hybrid
mode"). Each job:

    prefill(attempt)     where its KV goes (the destination the decode instance
                         reserved, ``attempt.destination``); posted as a ``Prefill``,
                         the prompt is queued as a hand-off request (engine/prefilled.py)
    on_last_chunk(last)  the step that completes these prompts: a per-layer callback
                         that sends each layer as it is computed (kv_transfer.layerwise),
                         and the ``SendList`` by which the other tensor-parallel ranks
                         send their heads                                 [sending]
    prefilled(p)         the first token is sampled: all layers sent now unless sent
                         layer-wise; on an ack thread, the END carrying the ``Handoff``
                         to every decode rank this rank sends to, then every answer
                         awaited; the outcome posted to the worker's loop as an
                         ``Acked`` (instance/inbox.py); each other tensor-parallel rank
                         (prefill_worker/prefill_rank.py) posts its own through the
                         worker's ``rank_acked``
    Acked (message)      every rank of the instance heard every END answered OK: the
                         blocks are released, Update(handed_off)            [acked]
                         a refusal, a broken link or no answer within the ack timeout:
                         blocks released, Update(retryable); the router redoes the
                         request on another pair                           [failed]

Runs on the worker's step loop (``prefilled``'s ack threads only post to it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engine.prefilled import LastChunkHook, Prefilled
from pdserve.instance.component import Component
from pdserve.instance.inbox import Acked, Prefill
from pdserve.instance.messages import Attempt, Update
from pdserve.kv_transfer import Handoff, KVDestination, backend_options, get_transport
from pdserve.kv_transfer import kv_transfer_pb2 as kv_pb
from pdserve.kv_transfer.layout import cache_layout

if TYPE_CHECKING:
    from pdserve.instance.worker import EngineWorker


def ack_timeout_s(lease_s: float) -> float:
    """How long a sender waits for its ENDs' answers: past the decode lease, so that a
    transfer that stalls is reported by the decode instance, which owns the reservation,
    not by whichever side's timer fires first."""
    return 1.5 * lease_s


@dataclass(eq=False)
class Job:
    """A request prefilled here: where its KV goes and how its transfer stands."""

    attempt: Attempt
    destination: KVDestination
    transfer_start: float | None = None  # wall clock, first layer handed to the transport
    send_error: str | None = None
    aborted: bool = False  # the client left while the KV was on its way
    results: dict[int, tuple[int, float, str | None]] = field(default_factory=dict)  # by rank


class Sending(Component):
    """The worker's ``prefill`` and ``rank_acked`` calls, the ``prefill`` feed command,
    the ``Prefill`` and ``Acked`` messages, the step's hand-offs and failures. Its other
    tensor-parallel ranks (``worker.ranks``) each send their heads."""

    def __init__(self, worker: EngineWorker, kv_config: dict):
        super().__init__(worker, kv_config)
        self.name, self.engine = worker.name, worker.engine
        self.layout = cache_layout(self.engine)
        self.kv = self.engine.kv_view()
        self.ranks, self.post = len(worker.ranks), worker.post
        worker.count("kv_bytes_total", 0)
        self.sender = get_transport(kv_config["backend"]).sender(
            self.layout,
            secret=kv_config["secret"],
            bind=kv_config["bind"],
            advertise=kv_config["advertise"],
            **backend_options(kv_config),
            checksum=kv_config["checksum"],
            name=self.name,
        )
        self.layerwise = kv_config["layerwise"]
        self.ack_timeout_s = ack_timeout_s(kv_config["lease_s"])
        self.jobs: dict[str, Job] = {}
        self._acks = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"{self.name}-acks")

    def handlers(self) -> dict[type, Callable[[Any], list[Update]]]:
        return {Prefill: self._on_prefill, Acked: self._on_acked}

    def feed_commands(self) -> dict[str, Callable[[Any], None]]:
        return {"prefill": self.prefill}

    def calls(self) -> dict[str, Callable[..., Any]]:
        return {"prefill": self.prefill, "rank_acked": self.rank_acked}

    def ready(self) -> dict:
        return {"kv_tp_size": self.layout.tp_size}

    def stats(self) -> dict:
        return {"in_transfer": self.in_transfer}

    def prefill(self, attempt: Attempt) -> None:
        """Prefill ``attempt``'s prompt and send its KV to ``attempt.destination`` (the
        reservation of the decode instance ``attempt.decode``)."""
        self.post(Prefill(attempt))

    def rank_acked(self, transfer_id: str, rank: int, nbytes: int, error: str | None) -> None:
        """Rank ``rank``'s ENDs of a transfer were answered (or failed): pushed by it."""
        self.post(Acked(transfer_id, rank, nbytes, 0.0, error))

    # ---- on the step loop ----

    def _on_prefill(self, m: Prefill) -> list[Update]:
        attempt, w = m.attempt, self.worker
        if w.take_early_abort(attempt.id):
            return []
        w.bind_consumer(attempt, choices=False)  # they fork where the KV lands
        try:
            if w.owns(attempt.id):
                raise ValueError(f"request_id={attempt.id!r}: already in use on {self.name}")
            self._add(attempt)
        except ValueError as e:
            return [Update(attempt.id, error=str(e))]
        w.count("requests_total")
        return []

    def last_chunk(self) -> LastChunkHook | None:
        """The step's hook while jobs are here; None otherwise, so that a decode
        instance's steps without one do no hand-off work (engine/prefilled.py)."""
        return self.on_last_chunk if self.jobs else None

    def _add(self, attempt: Attempt) -> None:
        """Queue ``attempt``'s prompt as a hand-off request bound for
        ``attempt.destination``; ValueError (nothing kept) when either is refused."""
        dst = KVDestination.from_bytes(attempt.destination)
        attempt.queue_in(self.engine, hand_off=True)
        self.jobs[attempt.id] = Job(attempt, dst)

    def owns(self, request_id: str) -> bool:
        return request_id in self.jobs

    @property
    def in_transfer(self) -> int:
        """Jobs whose prompt is done and whose transfer is not acknowledged yet."""
        return sum(1 for tid in self.jobs if tid not in self.engine.requests)

    def abort(self, request_id: str) -> list[Update]:
        if request_id in self.engine.requests:  # still prefilling: nothing was sent
            self.engine.abort_request(request_id)
            del self.jobs[request_id]
        else:  # its KV is on the way: the blocks go when the transfer ends
            self.jobs[request_id].aborted = True
        return []

    def fail(self, request_ids: list[str]) -> None:
        """These requests failed in a step (the engine dropped them): their transfers end."""
        for tid in request_ids:
            if self.jobs.pop(tid, None) is not None:
                self.sender.abort(tid)

    def on_last_chunk(self, last):
        """``LastChunkHook`` (engine/prefilled.py) for the requests in ``last``."""
        jobs = [self.jobs[r.request_id] for r in last]
        tables = {}  # what each sends: its table past the blocks the destination holds
        for j in jobs:
            table = self.kv.block_table(j.attempt.id)
            try:
                tables[j.attempt.id] = j.destination.source_blocks(table)
            except ValueError as e:  # sends nothing (the other ranks fail on no blocks)
                tables[j.attempt.id], j.send_error = [], f"{type(e).__name__}: {e}"
        caches = self.kv.layers

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

    def prefilled(self, p: Prefilled) -> list[Update]:
        """A job's request left the engine: END its transfer (module docstring)."""
        job = self.jobs[p.request.request_id]
        tid = job.attempt.id
        if p.error is not None:
            del self.jobs[tid]
            return [Update(tid, error=p.error, retryable=True)]
        if not self.layerwise:
            kv, dst = self.kv.cache, job.destination
            self._send(
                job, lambda: self.sender.send_all(tid, kv, dst.source_blocks(p.block_ids), dst)
            )
        times = {**p.times, "transfer_start": job.transfer_start or time.time()}
        lp = p.logprobs  # the first token's, when the request asked
        handoff = Handoff(
            p.first_token,
            times,
            self.name,
            first_logprob=None if lp is None else lp.logprob,
            top_ids=() if lp is None else lp.top_ids,
            top_logprobs=() if lp is None else lp.top_logprobs,
            cached_tokens=p.cached_tokens,
            **prompt_columns(p),
            **choice_columns(p),
        )
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
        self.post(Acked(tid, 0, nbytes, seconds, error))

    def _on_acked(self, m: Acked) -> list[Update]:
        """Rank ``m.rank``'s outcome of its transfer; the request's update once every
        rank's is in."""
        tid = m.attempt_id
        job = self.jobs.get(tid)
        if job is None:
            return []
        job.results[m.rank] = (m.nbytes, m.seconds, m.error)
        if len(job.results) < 1 + self.ranks:
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
        self.worker.count("kv_bytes_total", total)
        info = {"kv_bytes": total, "transfer_s": job.results[0][1]}
        return [Update(tid, handed_off=True, info=info)]

    def close(self) -> None:
        self._acks.shutdown(wait=False, cancel_futures=True)
        self.sender.close()


def prompt_columns(p: Prefilled) -> dict:
    """``Handoff``'s prompt logprob fields for ``p`` (none when it did not ask)."""
    if p.prompt_logprobs is None:
        return {}
    scored = [lp for lp in p.prompt_logprobs if lp is not None]  # the first token has none
    return {
        "prompt_top": p.request.params.prompt_logprobs,
        "prompt_logprobs": tuple(lp.logprob for lp in scored),
        "prompt_ranks": tuple(lp.rank for lp in scored),
        "prompt_top_ids": tuple(i for lp in scored for i in lp.top_ids),
        "prompt_top_logprobs": tuple(v for lp in scored for v in lp.top_logprobs),
    }


def choice_columns(p: Prefilled) -> dict:
    """``Handoff``'s fields of ``p``'s other choices' first tokens (none for one choice)."""
    if not p.choices:
        return {}
    lps = [lp for _, lp in p.choices if lp is not None]
    return {
        "choice_tokens": tuple(t for t, _ in p.choices),
        "choice_logprobs": tuple(lp.logprob for lp in lps),
        "choice_top_ids": tuple(i for lp in lps for i in lp.top_ids),
        "choice_top_logprobs": tuple(v for lp in lps for v in lp.top_logprobs),
    }
