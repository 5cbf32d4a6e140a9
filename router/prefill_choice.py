"""Where a request's prompt is computed in ``hybrid`` mode (docs/serving.md, "Hybrid
mode"): locally, by chunked prefill on the decode instance that will generate its
tokens, or remotely, on the prefill pool (or, without one, on a peer decode instance)
with its KV handed off to that instance.

``choose_prefill(inputs, costs)`` is a pure function of typed inputs: the router
(router/hybrid.py) calls it with what it knows of its instances, the planner's
simulator (planner/simulator.py) with its simulated state, so both take the same
decisions from the same state.

The rule, in predicted seconds until the first token (queues included):

    local  = work x local_token_s + steps x local_step_s
             work = decode queue + prompt - decode hit;
             steps = ceil(work / budget), budget = max_batch_tokens - running,
             at most mixed_prefill_tokens beside a running batch; a step's own cost
             (fixed, and the running batch's decodes) is paid once per chunk
    remote = work x remote_token_s + steps x remote_step_s
             + (prompt - decode hit) x transfer_token_s   (the blocks decode lacks)
             work = prefill queue + prompt - prefill hit;
             steps = ceil(work / remote budget), its budget as the local one's (a
             prefill instance runs no decodes: its max_batch_tokens)

Local wins when it is not slower, unless a chunk piggybacked on the running batch
would stretch its step past the TPOT objective (``local_step_s + chunk x
local_token_s > tpot_s``, chunk = min(prompt after hits, budget): refused, remote) and
the remote one would not (a peer decode instance's running batch is stretched alike;
refused there, local; stretched on both sides, the faster). A decode pool whose
``mixed_prefill_tokens`` keeps that step under the objective takes a prompt over
several steps instead. With no prefill instance alive, or after
the request's remote attempt failed, the prompt is prefilled locally whatever the
prediction (the fallback: the request completes rather than waiting for a pair).

Reasons are a bounded set (``REASONS``), the label of the router's counter
``pdserve:prefill_placement_total``; ``detail`` says it with the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.scheduler import prompt_budget

LOCAL, REMOTE = "local", "remote"
# (where, reason) pairs a decision can have
REASONS = (
    (LOCAL, "faster"),  # predicted first token no later than the remote path's
    (LOCAL, "fallback"),  # the request's remote attempt failed (transfer cut, peer gone)
    (LOCAL, "no_prefill"),  # no prefill instance is alive
    (REMOTE, "faster"),  # predicted first token sooner than the local path's
    (REMOTE, "tpot"),  # a local chunk would stretch the running batch past slo.tpot_ms
    (LOCAL, "tpot"),  # a chunk on the peer would stretch its running batch past it
)


@dataclass(frozen=True)
class PrefillCosts:
    """Measured costs (seconds), as ``router.prefill_costs.CostModel`` learns them.

    Invariant: every field >= 0."""

    local_step_s: float  # a decode instance's step beside its prompt tokens (fixed part
    # and the running batch's decodes)
    local_token_s: float  # one prompt token more in a decode instance's step
    remote_step_s: float  # a prefill instance's (or the peer's) step beside its prompt
    # tokens (a peer's: its running batch's decodes included)
    remote_token_s: float  # one prompt token more in that step
    transfer_token_s: float  # one token's KV sent from a prefill to a decode instance


@dataclass(frozen=True)
class PrefillInputs:
    """What is known of one request and its two candidate places when it is placed.

    ``prompt_tokens`` is what the KV covers (prompt + a resumed request's delivered
    tokens); the hits are leading tokens whose KV each side already holds (the
    router's view of the instances' prefix caches; 0 when unknown), each <
    ``prompt_tokens``."""

    prompt_tokens: int
    local_hit_tokens: int  # cached on the chosen decode instance
    remote_hit_tokens: int  # cached on the prefill instance the remote path would use
    remote_queue_tokens: int  # prompt tokens that prefill instance has yet to compute
    local_queue_tokens: int  # prompt tokens the decode instance has yet to compute
    running: int  # requests in the decode instance's running batch (its last report)
    max_batch_tokens: int  # the decode instance's step token budget
    remote_max_batch_tokens: int  # the prefill instance's (or the peer's)
    tpot_s: float  # slo.tpot_ms in seconds
    # the decode instance's prompt tokens beside running decodes (None: no cap)
    mixed_prefill_tokens: int | None = None
    remote_running: int = 0  # the peer decode instance's running batch (0: a prefill one)
    remote_mixed_prefill_tokens: int | None = None  # the peer's cap beside its decodes
    prefill_alive: bool = True  # some prefill instance (or peer) can take the request
    remote_failed: bool = False  # the request's previous attempt was remote and failed


@dataclass(frozen=True)
class PrefillChoice:
    where: str  # LOCAL or REMOTE
    reason: str  # one of REASONS' for ``where``
    detail: str  # the numbers behind it, for the request's trace
    local_s: float  # predicted seconds to the first token, local path
    remote_s: float  # the same, remote path (inf when there is none)

    @property
    def label(self) -> str:
        return f"{self.where}:{self.reason}"


def choose_prefill(i: PrefillInputs, c: PrefillCosts) -> PrefillChoice:
    """The decision for one request (module docstring: the rule)."""
    local_tokens = max(1, i.prompt_tokens - i.local_hit_tokens)
    remote_tokens = max(1, i.prompt_tokens - i.remote_hit_tokens)
    budget = _budget(i.max_batch_tokens, i.running, i.mixed_prefill_tokens)
    remote_budget = _budget(
        i.remote_max_batch_tokens, i.remote_running, i.remote_mixed_prefill_tokens
    )
    local_work = i.local_queue_tokens + local_tokens
    local_s = local_work * c.local_token_s + math.ceil(local_work / budget) * c.local_step_s
    remote_s = math.inf
    if i.prefill_alive:
        remote_work = i.remote_queue_tokens + remote_tokens
        remote_steps = math.ceil(remote_work / remote_budget)
        remote_s = remote_work * c.remote_token_s + remote_steps * c.remote_step_s
        remote_s += local_tokens * c.transfer_token_s
    numbers = (
        f"{local_tokens} tokens after hits locally ({local_s * 1000:.1f} ms, decode queue "
        f"{i.local_queue_tokens}), {remote_tokens} remotely ({remote_s * 1000:.1f} ms, "
        f"prefill queue {i.remote_queue_tokens})"
    )

    def decide(where: str, reason: str, why: str) -> PrefillChoice:
        return PrefillChoice(where, reason, f"{where} ({reason}): {why}", local_s, remote_s)

    if i.remote_failed:
        return decide(LOCAL, "fallback", f"the remote attempt failed; {numbers}")
    if not i.prefill_alive:
        return decide(LOCAL, "no_prefill", f"no prefill instance alive; {numbers}")
    step_s = c.local_step_s + min(local_tokens, budget) * c.local_token_s
    remote_step_s = c.remote_step_s + min(remote_tokens, remote_budget) * c.remote_token_s
    local_over = i.running > 0 and step_s > i.tpot_s
    remote_over = i.remote_running > 0 and remote_step_s > i.tpot_s
    if local_over and not remote_over:
        why = (
            f"a local chunk would make the running batch's ({i.running}) steps "
            f"{step_s * 1000:.1f} ms, past slo.tpot_ms={i.tpot_s * 1000:g}; "
            f"{numbers}"
        )
        return decide(REMOTE, "tpot", why)
    if remote_over and not local_over:
        why = (
            f"a chunk on the peer would make its running batch's ({i.remote_running}) "
            f"steps {remote_step_s * 1000:.1f} ms, past slo.tpot_ms="
            f"{i.tpot_s * 1000:g}; {numbers}"
        )
        return decide(LOCAL, "tpot", why)
    if local_s <= remote_s:
        return decide(LOCAL, "faster", numbers)
    return decide(REMOTE, "faster", numbers)


def _budget(max_batch_tokens: int, running: int, mixed_prefill_tokens: int | None) -> int:
    """Prompt tokens a step of an instance running ``running`` decodes carries (at least
    one: a prompt always moves)."""
    return max(1, prompt_budget(max_batch_tokens, running, mixed_prefill_tokens))
