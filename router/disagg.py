"""Disaggregated placement: a prefill instance computes the prompt, a decode instance
generates the rest (docs/kv_transfer.md has the handoff's state machine).

Per request (one ``Attempt``; the instances know it as ``<request id>#<attempt>``):

    choose decode (routing policy over those with room) and prefill (fewest queued
    prompt tokens; the policy's choice when it is cache-aware) -> decode.reserve(attempt):
    blocks held, the destination back (None: no room; the request goes back to the head
    of the queue)
    -> prefill.prefill(attempt + destination): chunked prefill, KV sent, the transfer
    ended with the first token -> decode admits it once landed and streams tokens;
    prefill reports the transfer acknowledged (handed off)

A failed handoff (transfer cut, lease expired, a peer gone) or a failed instance drops
the attempt on both instances and migrates the request (``RouterCore.migrate``): a new
attempt on another pair when there is one, re-prefilling prompt + the tokens the client
already has, up to ``router.migration_limit`` times. Once the decode instance streams
tokens, the prefill instance's failure no longer concerns the request.

Every path that ends an attempt (an error update, an instance's death, a failed or
refused reservation, a cancel) names the attempt it concerns and acts only through
``AttemptRecord.retire``: a decode instance that dies while its reservation is pending is
reported twice (its death, then the reservation's failure) and migrates its request once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from pdserve.instance.messages import Attempt, Update
from pdserve.router.instances import Instance
from pdserve.router.placement import Placement, RouterHooks
from pdserve.router.policies import RoutingPolicy
from pdserve.router.stream import Delta, RequestStream

log = logging.getLogger(__name__)


class Disaggregated(Placement):
    def __init__(self, hooks: RouterHooks, instances: list[Instance], policy: RoutingPolicy):
        super().__init__(hooks, instances, policy)
        self.prefills = [i for i in instances if i.role == "prefill"]
        self.decodes = [i for i in instances if i.role == "decode"]
        self._tasks: set[asyncio.Task] = set()

    @property
    def alive(self) -> bool:
        return any(i.dead is None for i in self.prefills) and any(
            i.dead is None for i in self.decodes
        )

    @property
    def recoverable(self) -> bool:
        def up(pool: list[Instance]) -> bool:
            return any(i.dead is None or i.restarting for i in pool)

        return up(self.prefills) and up(self.decodes)

    def can_place(self, stream: RequestStream) -> bool:
        return any(d.has_room() for d in self.decodes) and any(p.alive for p in self.prefills)

    def place(self, stream: RequestStream) -> None:
        decode, prefill = self._decode_for(stream), self._prefill_for(stream)
        assert prefill is not None  # can_place found a prefill instance alive, just before
        self._place_remote(stream, decode, prefill)

    def _place_remote(self, stream: RequestStream, decode: Instance, prefill: Instance) -> None:
        """Reserve on ``decode``, then prefill on ``prefill`` (the module docstring)."""
        attempt = self.attempt(
            stream,
            (prefill.name, decode.name),
            prefill_tp=prefill.info.get("kv_tp_size", 1),
            prefill=prefill.name,
            decode=decode.name,
        )
        stream.waits_for(f"{decode.name} to reserve blocks for the KV")
        decode.hold(stream)
        # the prefill instance computes the prompt and what the client already has
        prefill.hold(stream, prompt_tokens=len(stream.prompt_ids) + len(stream.token_ids))
        task = asyncio.get_running_loop().create_task(self._start(stream, attempt, prefill, decode))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _decode_for(self, stream: RequestStream) -> Instance:
        room = [d for d in self.decodes if d.has_room()]
        fresh = [d for d in room if d.name not in stream.attempt.avoid] or room
        choice = self.policy.choose(len(stream.prompt_ids), self.loads(stream, fresh))
        return self.by_name[choice.name]

    def _prefill_for(self, stream: RequestStream) -> Instance | None:
        """Fewest queued prompt tokens; with a cache-aware policy, the policy's choice
        (the prefix its cache holds, net of its queue), among those not avoided; None
        when no prefill instance is alive."""
        alive = [p for p in self.prefills if p.alive]
        if not alive:
            return None
        avoid = stream.attempt.avoid
        if self.policy.uses_cache:
            fresh = [p for p in alive if p.name not in avoid] or alive
            choice = self.policy.choose(len(stream.prompt_ids), self.loads(stream, fresh))
            return self.by_name[choice.name]
        return min(alive, key=lambda p: (p.name in avoid, p.load.prefill_tokens, p.load.index))

    async def _start(
        self, stream: RequestStream, attempt: Attempt, prefill: Instance, decode: Instance
    ) -> None:
        try:
            destination = await decode.reserve(attempt)
        except Exception as e:  # the decode instance died or refused the request
            why = f"decode instance {decode.name}: {e}"
            ended = self.unseat(stream, attempt, why)
            self._end_attempt(stream, attempt.id, why, retryable=True)
            self.hooks.ended([*ended, *([stream] if stream.finished else [])])
            return
        if stream.attempt.id != attempt.id:  # ended meanwhile (cancelled, a peer failed)
            if destination is not None:
                decode.abort([attempt.id])
            return
        if destination is None:  # no room after all: back to the head of the queue
            self.unseat(stream, attempt, None)  # its choices go with it
            stream.attempt.retire(attempt.id)
            self._drop(stream, attempt.id, abort=False)
            decode.refused = True
            stream.waits_for(f"a decode instance with room ({decode.name} refused)")
            self.hooks.requeue(stream)
            return
        stream.sent_to(prefill.name)
        stream.sent_to(decode.name)
        stream.waits_for(f"{prefill.name} to compute the prompt and send its KV to {decode.name}")
        prefill.prefill(replace(attempt, destination=destination))

    def on_updates(self, inst: Instance, updates: list[Update]) -> list[RequestStream]:
        ended = []
        for u in updates:
            stream = inst.streams.get(u.request_id)
            if stream is None:
                continue  # an abandoned attempt, or aborted meanwhile
            stream.attempt.report(u.info)
            if u.error is not None:
                self._end_attempt(
                    stream, u.request_id, u.error, u.retryable, reported_by=inst, invalid=u.invalid
                )
                if stream.finished:
                    ended.append(stream)
                continue
            if self.prefills_for(inst, stream):
                if u.handed_off:
                    inst.release(u.request_id)
                continue
            if stream.attempt.land():
                stream.waits_for(f"tokens from {inst.name}")
            stream.deliver(
                Delta(
                    u.token_ids,
                    u.text,
                    u.finish_reason,
                    logprobs=u.logprobs,
                    prompt_logprobs=u.prompt_logprobs,
                )
            )
            if u.finish_reason is not None:
                inst.release(u.request_id)
                ended.append(stream)
        return ended

    def on_dead(self, inst: Instance) -> list[RequestStream]:
        why = inst.dead
        assert why is not None  # the core calls on_dead after Instance.fail
        ended = []
        for attempt_id, stream in list(inst.streams.items()):
            self._end_attempt(stream, attempt_id, why, retryable=True, reported_by=inst)
            if stream.finished:
                ended.append(stream)
        return ended

    def cancel(self, stream: RequestStream) -> None:
        attempt_id = stream.attempt.id
        if stream.attempt.retire(attempt_id):
            self._drop(stream, attempt_id, abort=True)

    def _end_attempt(
        self,
        stream: RequestStream,
        attempt_id: str,
        error: str,
        retryable: bool,
        reported_by: Instance | None = None,
        invalid: bool = False,
    ) -> None:
        """Attempt ``attempt_id`` failed (``reported_by``, when given, forgets it): if it
        is still current (``retire``), drop it everywhere, then migrate the request or
        fail it (``invalid``: the request's own fault, ``Delta.failed``); a report of an
        attempt no longer current does nothing more. Once the
        decode instance streams tokens, its KV has landed: a failure reported by the
        prefill instance (a lost acknowledgement, its death) no longer concerns it, and
        only that instance's hold goes."""
        current = stream.attempt.id == attempt_id
        if reported_by is not None:  # it dropped the attempt itself (or is dead): no abort
            reported_by.release(attempt_id)
            if current and self.prefills_for(reported_by, stream) and stream.attempt.landed:
                log.warning("request %s: %s (after its KV landed)", stream.request_id, error)
                return
        if not stream.attempt.retire(attempt_id):
            return
        self._drop(stream, attempt_id, abort=True)
        if retryable:
            self.hooks.migrate(stream, error)
        else:
            stream.deliver(Delta.failed(error, invalid))

    def _drop(self, stream: RequestStream, attempt_id: str, abort: bool) -> None:
        """Every instance forgets the (retired) attempt; with ``abort`` it frees its blocks."""
        for inst in self.instances:
            inst.release(attempt_id, abort)

    @staticmethod
    def prefills_for(inst: Instance, stream: RequestStream) -> bool:
        """``inst`` computes the prompt of ``stream``'s attempt for another instance: a
        prefill instance, or a peer decode instance (hybrid mode, router/hybrid.py)."""
        pair = stream.attempt.pair
        return len(pair) == 2 and pair[0] == inst.name
