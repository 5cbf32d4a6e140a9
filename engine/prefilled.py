"""A request that leaves its engine at its first token (``add_request(hand_off=True)``):
its prompt is computed here and its KV goes to another instance, which decodes it
(the prefill pool's every request; docs/kv_transfer.md has the handoff).

It runs as any other request, its prompt in chunks under the token budget, FCFS, beside
whatever else the step carries. In the step that samples its first token it leaves the
scheduler and the engine as a ``Prefilled``; its blocks stay held under its id, since
the KV transfer reads them, until ``LLMEngine.release`` once the transfer is
acknowledged. With prefix caching on, it starts from its cached prefix (only the rest of
its prompt is computed; its table's leading blocks are then shared, holding valid KV all
the same), its full blocks are registered as each step fills them, and ``release``
leaves the registered ones CACHED for the next prompt that shares them.

``LLMEngine.step(on_last_chunk)`` lets the caller hook the forward pass of the hand-off
requests whose last chunk runs in it (``LastChunkHook``: layer-wise sending).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.outputs import Logprobs
from pdserve.engine.request import Request

# Given the hand-off requests whose prompt completes in this step: a per-layer callback
# (or None) and bytes for the other tensor-parallel ranks (StepPlan.extra).
LastChunkHook = Callable[[list[Request]], tuple[Callable[[int], None] | None, bytes]]


@dataclass
class Prefilled:
    """A hand-off request whose prompt (and delivered output, when resumed) is in the cache
    and whose first token is sampled, at output position ``len(delivered)``."""

    request: Request
    first_token: int
    block_ids: list[int]
    times: dict[str, float] = field(default_factory=dict)  # wall clock: prefill_start/end
    error: str | None = None  # set instead when the prompt cannot be prefilled here
    logprobs: Logprobs | None = None  # the first token's, when the request asked
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    # the prompt's, when the request asked (RequestOutput.prompt_logprobs)
    prompt_logprobs: list[Logprobs | None] | None = None
    # choices 1 .. n - 1's first tokens (and logprobs), drawn with the request's
    # (engine/choices.py): they fork where its KV lands
    choices: list[tuple[int, Logprobs | None]] = field(default_factory=list)
