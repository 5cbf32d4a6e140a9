"""Hybrid placement: the pools of disaggregated serving, with the choice, per request, of
where its prompt is computed (docs/serving.md, "Hybrid mode"). Without a prefill pool
(``prefill.instances: 0``) the decode instances are each other's: the remote path
prefills on a peer decode instance (the one with the fewest queued prompt tokens; the
policy's choice when it is cache-aware) beside that peer's own decodes, whose running
batch the choice counts as it counts the local one's.

Per request (one ``Attempt``):

    choose decode (routing policy over those with room, as disaggregated)
    -> choose_prefill (router/prefill_choice.py) from the request, the two candidate
       instances' queues and running batch, and the learned costs
       (router/prefill_costs.py)
    -> local:  decode.add(attempt), the co-located path: the decode instance runs the
               prompt in chunks piggybacked on its running batch, then decodes it
       remote: the disaggregated path (router/disagg.py): reserve, prefill, hand off

A remote attempt that fails (a transfer cut, a lease expired, a peer gone) migrates
(``RouterCore.migrate``, bounded by ``router.migration_limit``) and its next attempt is
prefilled locally: the request completes on the decode pool instead of waiting for
another prefill pair. Hybrid serves while any decode instance is alive: with the
whole prefill pool down, every prompt is prefilled locally.

Each decision (its detail) is appended to the request's trace
(``RequestStream.prefill_choices``, the request's log line) and counted in
``pdserve:prefill_placement_total{where, reason}`` (router/metrics.py).
"""

from __future__ import annotations

from router.disagg import Disaggregated
from router.instances import Instance
from router.prefill_choice import LOCAL, REMOTE, PrefillInputs, choose_prefill
from router.prefill_costs import CostModel
from router.stream import RequestStream


class Hybrid(Disaggregated):
    def __init__(self, router, instances, policy, costs: CostModel, tpot_s: float):
        """``costs``: the learned costs; ``tpot_s``: slo.tpot_ms in seconds."""
        super().__init__(router, instances, policy)
        self.costs, self.tpot_s = costs, tpot_s
        self.peers = not self.prefills  # the decode instances prefill for each other
        # local attempts whose prompt is not computed yet: attempt id -> (decode
        # instance, the tokens counted in its ``load.prefill_tokens``)
        self._local: dict[str, tuple[Instance, int]] = {}

    @property
    def alive(self) -> bool:
        return any(d.dead is None for d in self.decodes)

    @property
    def recoverable(self) -> bool:
        return any(d.dead is None or d.restarting for d in self.decodes)

    def can_place(self, stream: RequestStream) -> bool:
        return any(d.has_room() for d in self.decodes)

    def place(self, stream: RequestStream) -> None:
        decode = self._decode_for(stream)
        prefill = self._peer_for(stream, decode) if self.peers else self._prefill_for(stream)
        self.costs.kv_bytes_per_token = decode.info.get("kv_bytes_per_token", 0)
        last = stream.prefill_choices[-1] if stream.prefill_choices else None
        inputs = PrefillInputs(
            prompt_tokens=len(stream.prompt_ids) + len(stream.token_ids),
            local_hit_tokens=self.hit_tokens(decode, stream),
            remote_hit_tokens=self.hit_tokens(prefill, stream) if prefill else 0,
            remote_queue_tokens=prefill.load.prefill_tokens if prefill else 0,
            local_queue_tokens=decode.load.prefill_tokens,
            running=decode.load.running,
            max_batch_tokens=decode.info["max_batch_tokens"],
            mixed_prefill_tokens=decode.info.get("mixed_prefill_tokens"),
            remote_max_batch_tokens=prefill.info["max_batch_tokens"] if prefill else 1,
            remote_running=prefill.load.running if prefill and self.peers else 0,
            remote_mixed_prefill_tokens=prefill.info.get("mixed_prefill_tokens")
            if prefill and self.peers
            else None,
            tpot_s=self.tpot_s,
            prefill_alive=prefill is not None,
            remote_failed=stream.attempt > 0 and last is not None and last.where == REMOTE,
        )
        peer_running = inputs.remote_running if self.peers else None
        choice = choose_prefill(inputs, self.costs.costs(inputs.running, peer_running))
        stream.prefill_choices.append(choice)
        self.router.metrics.prefill_placed(choice.where, choice.reason)
        if choice.where == LOCAL:
            self._place_local(stream, decode, inputs.prompt_tokens - inputs.local_hit_tokens)
        else:
            assert prefill is not None  # choose_prefill goes remote only to a live one
            self._place_remote(stream, decode, prefill)

    def _peer_for(self, stream: RequestStream, decode: Instance) -> Instance | None:
        """The peer decode instance that would prefill for ``decode``: fewest queued
        prompt tokens, or the policy's choice when it is cache-aware, among those alive
        and not avoided; None when ``decode`` has no live peer."""
        alive = [d for d in self.decodes if d is not decode and d.alive]
        if not alive:
            return None
        fresh = [d for d in alive if d.name not in stream.avoid] or alive
        if self.policy.uses_cache:
            choice = self.policy.choose(len(stream.prompt_ids), self.loads(stream, fresh))
            return self.by_name[choice.name]
        return min(fresh, key=lambda d: (d.load.prefill_tokens, d.load.index))

    def _place_local(self, stream: RequestStream, decode: Instance, tokens: int) -> None:
        attempt = self.attempt(stream, decode=decode.name)
        stream.pair = (decode.name,)
        decode.hold(stream)
        decode.load.prefill_tokens += tokens
        self._local[attempt.id] = (decode, tokens)
        stream.sent_to(decode.name)
        stream.waits_for(f"tokens from {decode.name} (it computes the prompt)")
        decode.add(attempt)

    def on_updates(self, inst: Instance, updates: list) -> list[RequestStream]:
        self.costs.observe_stats(inst.name, inst.role, inst.last_stats)
        if inst.role == "decode":
            for u in updates:
                self._prompt_done(u.request_id)  # its first token (or its end) is out
                stream = inst.streams.get(u.request_id)
                decoded = stream is not None and not self.prefills_for(inst, stream)
                if decoded and u.info.get("kv_bytes"):  # the decode side's report
                    self.costs.observe_transfer(u.info["kv_bytes"], u.info["transfer_s"])
        return super().on_updates(inst, updates)

    def _drop(self, stream: RequestStream, attempt_id: str, abort: bool) -> None:
        self._prompt_done(attempt_id)
        super()._drop(stream, attempt_id, abort)

    def _prompt_done(self, attempt_id: str) -> None:
        """A local attempt's prompt no longer waits on its decode instance."""
        held = self._local.pop(attempt_id, None)
        if held is not None:
            held[0].load.prefill_tokens -= held[1]
