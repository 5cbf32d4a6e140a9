"""The simulator's side of hybrid mode: the router's prefill choice
(router/prefill_choice.py, the same function) fed with the simulated state, its costs
taken from the cost model instead of learned from served steps."""

from __future__ import annotations

import math

from pdserve.engine.scheduler import prompt_budget
from pdserve.router.prefill_choice import PrefillChoice, PrefillCosts, PrefillInputs, choose_prefill


def _step_costs(cost, inst, n: int) -> tuple[float, float]:
    """(step_s, token_s) of a prompt of ``n`` tokens on ``inst``: its running batch's
    decode step (none on a prefill instance) and a token of the chunk it rides in."""
    batch, pool = len(inst.batch), inst.pool
    chunk = max(1, min(n, prompt_budget(pool.max_batch_tokens, batch, pool.mixed_prefill_tokens)))
    step_s = cost.decode_s(batch, inst.batch.context, inst.pool.tp) if batch else 0.0
    return step_s, cost.prefill_s(chunk, chunk**2, inst.pool.tp) / chunk


def prefill_choice(
    sim, r, decode, prefill, local_hit: int = 0, remote_hit: int = 0
) -> PrefillChoice:
    """Where request ``r`` is prefilled: on ``decode`` (the instance that will decode it,
    chosen already) or on ``prefill`` (the one the remote path would use: a prefill
    instance, or a peer decode instance; None: there is none). The hits: leading
    prompt tokens each one's prefix cache holds (``planner.prefix``). Called
    before ``r`` counts in either instance's load, as the router does."""
    cost, n = sim.cost, r.prompt_len
    local_step_s, local_token_s = _step_costs(cost, decode, n)
    remote_step_s, remote_token_s = _step_costs(cost, prefill, n) if prefill else (0.0, 0.0)
    kv_bytes = cost.transfer_bytes(n, decode.pool.tp)  # its cost per token, at this size
    costs = PrefillCosts(  # a step's fixed cost folded into this prompt's chunk's tokens
        local_step_s=local_step_s,
        local_token_s=local_token_s,
        remote_step_s=remote_step_s,
        remote_token_s=remote_token_s,
        transfer_token_s=cost.transfer_s(kv_bytes) / n,
    )
    tpot_ms = sim.cluster.tpot_ms
    inputs = PrefillInputs(
        prompt_tokens=n,
        local_hit_tokens=local_hit,
        remote_hit_tokens=remote_hit,
        remote_queue_tokens=prefill.queued_tokens if prefill else 0,
        local_queue_tokens=decode.queued_tokens,
        running=len(decode.batch),
        max_batch_tokens=decode.pool.max_batch_tokens,
        mixed_prefill_tokens=decode.pool.mixed_prefill_tokens,
        remote_max_batch_tokens=prefill.pool.max_batch_tokens if prefill else 1,
        remote_running=len(prefill.batch) if prefill else 0,
        remote_mixed_prefill_tokens=prefill.pool.mixed_prefill_tokens if prefill else None,
        tpot_s=math.inf if tpot_ms is None else tpot_ms / 1000,
        prefill_alive=prefill is not None,
    )
    return choose_prefill(inputs, costs)
