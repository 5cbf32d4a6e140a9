"""The receiving component (instance/component.py) of a decode instance: it reserves
blocks and receives KV into them, and the worker's engine decodes. The handoff's state
machine is drawn in docs/kv_transfer.md; here:

    reserve(attempt)  (the worker's call, or the ``reserve`` feed command, whose answer
                      goes down the consumer's feed; both a ``Reserve`` message) the
                      engine takes the request as waiting for its KV
                      (``LLMEngine.reserve``, engine/reservation.py: placeholders
                      before a sliding window, a shared cached prefix, new blocks);
                      the new blocks are expected by the KV receiver of every rank,
                      each sliding layer's from the first in its window on
                      (``layer_skip``); returns the KVDestination the prefill
                      instance sends to (None: no room). No timer runs yet: the
                      prefill may be queued.
    landed            (the receiver's one event, pushed to the loop's inbox) every
                      segment from every source rank, every END and every other rank's
                      report are in: the request lands (``LLMEngine.land``) with the
                      first token that source rank 0's END carried, and its tokens
                      stream to the router
    forward           (a replicated MLA latent under tensor parallelism only) the row
                      crossed the wire once, into rank 0's blocks; in the same turn of
                      the loop, before the request joins the batch, rank 0 copies those
                      blocks into the other ranks' over the instance's tensor-parallel
                      group (``LLMEngine.copy_landed``, ordered with the steps). A copy
                      that fails ends the instance as a failed step does (its ranks are
                      out of step): the router redoes the attempt elsewhere
    failed / expired  the transfer broke, or made no progress for kv_transfer.lease_s
                      (the lease: the only timer that frees a reservation, kept by rank
                      0's receiver): the reservation is released, Update(retryable)
    abort             released in any state (``LLMEngine.release``)

In hybrid mode without a prefill pool (docs/serving.md, "Hybrid mode") a decode
instance also holds the sending component (prefill_worker/sending.py) and prefills
prompts for its peers beside its own decodes, one tensor-parallel rank only.

Blocks are freed only once every rank released the transfer (its receiver writes no
byte after that), so no byte of a released reservation lands in reused blocks; a
forwarded reservation is expected by rank 0 alone, and its copy runs on the loop, which
also releases: a released reservation is never copied. The shared blocks are never
written by a transfer (the receivers expect only the new ones); freeing a reservation
drops its references to them, and they stay cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pdserve.engine.outputs import Logprobs
from pdserve.engine.reservation import NoRoom
from pdserve.instance.component import Component
from pdserve.instance.inbox import Expected, Landed, Released, Reserve
from pdserve.instance.messages import Attempt, Reserved, Update
from pdserve.kv_transfer import (
    Handoff,
    KVDestination,
    Outcome,
    State,
    backend_options,
    get_transport,
)
from pdserve.kv_transfer.layout import cache_layout

if TYPE_CHECKING:
    from pdserve.instance.worker import EngineWorker


def _one_line(e: BaseException) -> str:
    """An exception as a ``Reserved`` error: its type and its message's first line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


@dataclass
class Expecting:
    """A reservation waiting for the other ranks' receivers to expect it: ``left`` of
    their answers still to come, the first ``error`` among them, and where the answer
    goes (``tell``)."""

    left: int
    tell: Callable[[Reserved], None]
    error: str | None = None


class Receiving(Component):
    """The worker's ``reserve`` and ``rank_landed`` calls, the ``reserve`` feed command,
    the ``Reserve``, ``Expected``, ``Landed`` and ``Released`` messages; the reservations
    (attempt and destination by attempt id) until they land or go."""

    def __init__(self, worker: EngineWorker, kv_config: dict):
        super().__init__(worker, kv_config)
        self.name, self.engine, self.ranks = worker.name, worker.engine, worker.ranks
        self.layout = cache_layout(self.engine)
        self.transport = get_transport(kv_config["backend"])
        self.receiver = self.transport.receiver(
            self.layout,
            self.engine.kv_view().cache,
            secret=kv_config["secret"],
            bind=kv_config["bind"],
            advertise=kv_config["advertise"],
            **backend_options(kv_config),
        )
        self.receiver.on_event = lambda outcome: worker.post(Landed(outcome))
        self.lease_s = kv_config["lease_s"]
        # a replicated latent crosses the wire once, to rank 0, which forwards it
        self.forwards = bool(self.ranks) and self.layout.replicated
        self.reservations: dict[str, Attempt] = {}
        self.destinations: dict[str, KVDestination] = {}  # by reserved attempt id
        self._releasing: dict[str, int] = {}  # attempt id -> ranks yet to confirm a release
        self.addresses = [self.receiver.address]  # one KV receiver per tensor-parallel rank
        if self.ranks:
            import ray

            self.addresses += [
                i["kv_address"] for i in ray.get([r.ready.remote() for r in self.ranks])
            ]
        self._expecting: dict[str, Expecting] = {}  # by attempt id
        worker.count("kv_bytes_total", 0)
        worker.count("leases_expired_total", 0)

    def handlers(self) -> dict[type, Callable[[Any], list[Update]]]:
        return {
            Reserve: self._on_reserve,
            Expected: self._on_expected,
            Landed: self._on_landed,
            Released: self._on_released,
        }

    def feed_commands(self) -> dict[str, Callable[[Any], None]]:
        return {"reserve": self._reserve_down_feed}

    def calls(self) -> dict[str, Callable[..., Any]]:
        return {"reserve": self.reserve, "rank_landed": self.rank_landed}

    def ready(self) -> dict:
        """Also the KV receivers' addresses and the KV bytes of one token (all layers,
        every rank's share: what a handoff into this instance moves per token, hybrid
        mode's cost; ``KVLayout.transfer_bytes``)."""
        per_block = self.layout.transfer_bytes(1, self.layout.tp_size)
        return {
            "kv_addresses": self.addresses,
            "kv_bytes_per_token": per_block // self.layout.block_size,
        }

    def reserve(self, attempt: Attempt) -> bytes | None:
        """Hold blocks for ``attempt``'s prompt + delivered tokens (the KV the prefill
        instance computes); the ``KVDestination`` (protobuf bytes) to send that KV to, or
        None when this instance has no room. Raises ``RuntimeError`` naming what failed
        (nothing is held then)."""
        future: Future = Future()
        self.worker.post(Reserve(attempt, future.set_result))
        answer: Reserved = future.result()
        if answer.error is not None:
            raise RuntimeError(answer.error)
        return answer.destination

    def _reserve_down_feed(self, attempt: Attempt) -> None:
        """``reserve`` sent up the update feed (the router's way): its answer, a
        ``Reserved``, goes down the feed of ``attempt.consumer``."""
        w = self.worker
        w.post(Reserve(attempt, lambda answer: w.answer(attempt.consumer, answer)))

    def rank_landed(self, transfer_id: str, rank: int, nbytes: int, error: str | None) -> None:
        """Rank ``rank``'s part of a transfer landed (or failed): pushed by that rank."""
        self.receiver.rank_event(transfer_id, rank, nbytes, error)

    def close(self) -> None:
        self.receiver.close()

    # ---- on the step loop ----

    def _on_reserve(self, m: Reserve) -> list[Update]:
        """Reserve, then ``tell`` the answer; with other ranks that receive, once each
        has answered ``expect`` (their Ray calls complete off the loop, as ``Expected``
        messages): nothing may be sent to a rank that does not expect it."""
        attempt, tell = m.attempt, m.tell
        try:
            dst = self._reserve(attempt)
        except Exception as e:  # a layout the receiver refuses, an id in use
            tell(Reserved(attempt.id, error=_one_line(e)))
            return []
        if dst is None or not self.ranks or self.forwards:
            tell(Reserved(attempt.id, None if dst is None else dst.to_bytes()))
            return []
        refs = [
            r.expect.remote(
                attempt.id,
                list(dst.block_ids),
                attempt.prefill_tp,
                dst.token,
                attempt.prefill,
                list(dst.layer_skip),
            )
            for r in self.ranks
        ]
        self._expecting[attempt.id] = Expecting(len(refs), tell)
        for ref in refs:
            ref.future().add_done_callback(
                lambda f, rid=attempt.id: self.worker.post(Expected(rid, f.exception()))
            )
        return []

    def _on_expected(self, m: Expected) -> list[Update]:
        attempt_id, error = m.attempt_id, m.error
        waiting = self._expecting[attempt_id]
        waiting.left -= 1
        if error is not None and waiting.error is None:
            waiting.error = _one_line(error)
        if waiting.left:
            return []
        del self._expecting[attempt_id]
        dst = self.destinations.get(attempt_id)
        if dst is not None and waiting.error is None:
            waiting.tell(Reserved(attempt_id, dst.to_bytes()))
            return []
        waiting.tell(Reserved(attempt_id, error=waiting.error or "released meanwhile"))
        return self.worker.abort_now([attempt_id]) if dst is not None else []

    def _reserve(self, attempt: Attempt) -> KVDestination | None:
        if self.worker.take_early_abort(attempt.id):
            return None
        if attempt.id in self.reservations:
            raise ValueError(f"request_id={attempt.id!r}: already in use on {self.name}")
        r = self.engine.reserve(
            attempt.id,
            list(attempt.prompt_ids),
            attempt.params,
            attempt.delivered,
            attempt.delivered_chars,
            attempt.choices,
        )
        if isinstance(r, NoRoom):
            return None
        src = replace(self.layout, tp_size=attempt.prefill_tp, tp_rank=0)
        try:  # the receiver mints the transfer's token: its only name on the wire
            ranks = 1 if self.forwards else 1 + len(self.ranks)
            token = self.receiver.expect(
                attempt.id,
                list(r.block_ids),
                src,
                self.lease_s,
                ranks,
                sender=attempt.prefill,
                layer_skip=r.layer_skip,
            )
        except Exception:  # a layout the receiver refuses: nothing stays held
            self.engine.release(attempt.id)
            raise
        dst = KVDestination(
            tuple(self.addresses),
            r.block_ids,
            self.layout,
            self.transport.name,
            token,
            r.cached_blocks,
            r.outside_blocks,
            r.layer_skip,
        )
        self.reservations[attempt.id], self.destinations[attempt.id] = attempt, dst
        self.worker.bind_consumer(attempt)
        return dst

    def _on_landed(self, m: Landed) -> list[Update]:
        outcome = m.outcome
        attempt = self.reservations.pop(outcome.transfer_id, None)
        if attempt is None:
            return []  # released meanwhile (aborted)
        dst = self.destinations.pop(attempt.id)
        start = outcome.state == State.LANDED and outcome.handoff is not None
        self._release(attempt.id, free=not start)
        if start and self.forwards:  # before the request runs; its cached prefix is alike
            try:
                self.engine.copy_landed(attempt.id)
            except Exception:  # a rank gone or a broken group: the process ends here
                return self.worker.fail([attempt.id])
        if start:
            return self._start(attempt, outcome, dst)
        if outcome.state == State.EXPIRED:
            self.worker.count("leases_expired_total")
            why = (
                f"KV transfer {attempt.id!r} to {self.name} made no progress within "
                f"kv_transfer.lease_s={self.lease_s:g}s; its reservation was released "
                f"({outcome.error})"
            )
        else:
            why = str(outcome.error or "source rank 0 ended the transfer without a handoff")
        return [Update(attempt.id, error=why, retryable=True)]

    def _start(self, attempt: Attempt, outcome: Outcome, dst: KVDestination) -> list[Update]:
        """Admit a request whose KV landed. Its first update's ``info`` reports the
        handoff: ``kv_bytes`` (what moved: the blocks past those outside the window and
        the ``kv_cached_tokens`` this instance held, whole blocks, less those a sliding
        layer skipped), ``cached_tokens`` (the prefill instance's prefix hit), phases.
        The blocks some layer did not receive hold stale KV in that layer: they are
        never registered in the prefix cache (``Reservation.partial_blocks``)."""
        h, now = outcome.handoff, time.time()
        assert h is not None  # _op_landed starts only a landed transfer, with its handoff
        times = {**h.phase_times, "transfer_end": now}
        first = None  # the first token's logprobs, sampled with it on the prefill instance
        if h.first_logprob is not None:
            first = Logprobs(h.first_token, h.first_logprob, h.top_ids, h.top_logprobs)
        try:
            outs = self.engine.land(
                attempt.id, h.first_token, first, prompt_rows(attempt, h), choice_draws(h)
            )
        except ValueError as e:  # the engine released it
            return [Update(attempt.id, error=str(e))]
        times["decode_start"] = time.time()
        self.worker.count("requests_total", len(outs))
        self.worker.count("kv_bytes_total", outcome.bytes)
        self.worker.count("tokens_total", len(outs))
        info = {
            "phases": times,
            "kv_bytes": outcome.bytes,
            "transfer_s": outcome.seconds,
            "prefill_instance": h.prefill_instance,
            "cached_tokens": h.cached_tokens,
            "kv_cached_tokens": dst.cached_blocks * self.layout.block_size,
        }
        # the request's other choices, forked from it here: its KV moved once, for all
        forked = {**info, "kv_bytes": 0, "forked_from": attempt.id}
        return [
            Update.of(o.request_id, o, info if o.request_id == attempt.id else forked) for o in outs
        ]

    def _release(self, attempt_id: str, free: bool = True) -> None:
        """Take the transfer out of every rank's receiver; with ``free``, then its blocks
        are freed (else the request runs in them)."""
        self.receiver.release(attempt_id)
        if not self.ranks or self.forwards:  # the other ranks' receivers hold nothing
            if free:
                self.engine.release(attempt_id)
            return
        refs = [r.release.remote(attempt_id) for r in self.ranks]
        if free:  # once every rank confirmed (counted on the loop): no byte lands after
            self._releasing[attempt_id] = len(refs)
            for ref in refs:
                ref.future().add_done_callback(lambda _: self.worker.post(Released(attempt_id)))

    def _on_released(self, m: Released) -> list[Update]:
        attempt_id = m.attempt_id
        self._releasing[attempt_id] -= 1
        if not self._releasing[attempt_id]:
            del self._releasing[attempt_id]
            self.engine.release(attempt_id)
        return []

    def owns(self, request_id: str) -> bool:
        return request_id in self.reservations

    def abort(self, request_id: str) -> list[Update]:
        del self.reservations[request_id], self.destinations[request_id]
        self._release(request_id)
        return []

    def fail(self, request_ids: list[str]) -> None:
        """Nothing kept: a reserved request joins no step before it lands (and leaves
        ``reservations`` then)."""

    def stats(self) -> dict:
        return {"reserved": len(self.reservations)}


def prompt_rows(attempt: Attempt, h: Handoff) -> list[Logprobs | None] | None:
    """The prompt logprobs ``h`` carries, one per prompt token of ``attempt`` (None for
    the first), or None when the request did not ask."""
    if h.prompt_top is None:
        return None
    k, prompt = h.prompt_top, attempt.prompt_ids
    rows: list[Logprobs | None] = [None]
    for i, (value, rank) in enumerate(zip(h.prompt_logprobs, h.prompt_ranks, strict=True)):
        ids, values = h.prompt_top_ids[i * k : i * k + k], h.prompt_top_logprobs[i * k : i * k + k]
        rows.append(Logprobs(prompt[i + 1], value, ids, values, rank))
    return rows


def choice_draws(h: Handoff) -> list[tuple[int, Logprobs | None]]:
    """Choices 1 .. n - 1's first tokens ``h`` carries, with their logprobs when the
    request asked (``LLMEngine.land``'s ``choices``)."""
    if h.first_logprob is None:
        return [(t, None) for t in h.choice_tokens]
    k = len(h.top_ids)
    return [
        (
            t,
            Logprobs(
                t,
                h.choice_logprobs[i],
                h.choice_top_ids[i * k : i * k + k],
                h.choice_top_logprobs[i * k : i * k + k],
            ),
        )
        for i, t in enumerate(h.choice_tokens)
    ]
