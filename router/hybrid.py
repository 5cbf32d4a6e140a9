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
(``AttemptRecord.choices``, the request's log line) and handed to ``on_choice`` (the
core counts it in ``pdserve:prefill_placement_total{where, reason}``, router/metrics.py).
A local attempt's prompt is counted in its decode instance's queued prompt tokens
(``Instance.hold``) until its first token or its end (``Instance.prompt_done``).
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.router.disagg import Disaggregated
from pdserve.router.instances import Instance
from pdserve.router.placement import RouterHooks
from pdserve.router.policies import RoutingPolicy
from pdserve.router.prefill_choice import (
    LOCAL,
    REMOTE,
    PrefillChoice,
    PrefillInputs,
    choose_prefill,
)
from pdserve.router.prefill_costs import CostModel
from pdserve.router.stream import RequestStream


class Hybrid(Disaggregated):
    def __init__(
        self,
        hooks: RouterHooks,
        instances: list[Instance],
        policy: RoutingPolicy,
        costs: CostModel,
        tpot_s: float,
        on_choice: Callable[[PrefillChoice], None],
    ):
        """``costs``: the learned costs; ``tpot_s``: slo.tpot_ms in seconds;
        ``on_choice``: told of each decision (the core's metrics)."""
        super().__init__(hooks, instances, policy)
        self.costs, self.tpot_s, self.on_choice = costs, tpot_s, on_choice
        self.peers = not self.prefills  # the decode instances prefill for each other

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
        record = stream.attempt
        last = record.choices[-1] if record.choices else None
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
            remote_failed=record.number > 0 and last is not None and last.where == REMOTE,
        )
        peer_running = inputs.remote_running if self.peers else None
        choice = choose_prefill(inputs, self.costs.costs(inputs.running, peer_running))
        record.chose(choice)
        self.on_choice(choice)
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
        fresh = [d for d in alive if d.name not in stream.attempt.avoid] or alive
        if self.policy.uses_cache:
            choice = self.policy.choose(len(stream.prompt_ids), self.loads(stream, fresh))
            return self.by_name[choice.name]
        return min(fresh, key=lambda d: (d.load.prefill_tokens, d.load.index))

    def _place_local(self, stream: RequestStream, decode: Instance, tokens: int) -> None:
        attempt = self.attempt(stream, (decode.name,), decode=decode.name)
        decode.hold(stream, prompt_tokens=tokens)
        stream.sent_to(decode.name)
        stream.waits_for(f"tokens from {decode.name} (it computes the prompt)")
        decode.add(attempt)

    def on_updates(self, inst: Instance, updates: list) -> list[RequestStream]:
        self.costs.observe_stats(inst.name, inst.role, inst.last_stats)
        if inst.role == "decode":
            for u in updates:
                stream = inst.streams.get(u.request_id)
                if stream is None or self.prefills_for(inst, stream):
                    continue  # not held, or the prefill side of a peer's handoff
                inst.prompt_done(u.request_id)  # its first token (or its end) is out
                if u.info.get("kv_bytes"):  # the decode side's report
                    self.costs.observe_transfer(u.info["kv_bytes"], u.info["transfer_s"])
        return super().on_updates(inst, updates)
