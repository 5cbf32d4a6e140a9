"""The prefill pool's engine: chunked prefill only.

Prompts run in chunks under the token budget, several requests' chunks per step, FCFS
(engine/scheduler.py; nothing here ever decodes). A request leaves the engine in the
step that samples its first token, as a ``Prefilled``: its blocks stay held under its
id, since the KV transfer reads them, until ``release`` once the transfer is
acknowledged. With prefix caching on, a request starts from its cached prefix (only the
rest of its prompt is computed; its table's leading blocks are then shared, holding
valid KV all the same), its full blocks are registered as each step fills them, and
``release`` leaves the registered ones CACHED for the next prompt that shares them.
``step(on_last_chunk)`` lets the worker hook the forward pass of the requests whose
last chunk runs in it (layer-wise sending).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from engine.outputs import Logprobs
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledBatch

# Given the requests whose prompt completes in this step: a per-layer callback (or None)
# and bytes for the other tensor-parallel ranks (StepPlan.extra).
LastChunkHook = Callable[[list[Request]], tuple[Callable[[int], None] | None, bytes]]


@dataclass
class Prefilled:
    """A request whose prompt (and delivered output, when resumed) is in the cache and
    whose first token is sampled, at output position ``len(delivered)``."""

    request: Request
    first_token: int
    block_ids: list[int]
    times: dict[str, float] = field(default_factory=dict)  # wall clock: prefill_start/end
    error: str | None = None  # set instead when the prompt cannot be prefilled here
    logprobs: Logprobs | None = None  # the first token's, when the request asked
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)


class PrefillEngine(LLMEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started: dict[str, float] = {}  # request id -> first chunk scheduled

    def step(self, on_last_chunk: LastChunkHook | None = None) -> list[Prefilled]:
        batch = self.scheduler.schedule()
        self.last_shape = batch.shape() if batch else None
        now = time.time()
        for request, _ in batch.items:
            self.started.setdefault(request.request_id, now)
        last = [r for r, n in batch.items if r.num_computed_tokens + n == r.num_tokens]
        on_layer, extra = on_last_chunk(last) if on_last_chunk is not None and last else (None, b"")
        sampled = self.runner.run(batch, on_layer, extra) if batch else []
        self.scheduler.commit(batch)
        return self._handoffs(batch, sampled)

    def release(self, request_id: str) -> None:
        """Free the blocks of a request that left the engine (its transfer is over)."""
        self.blocks.free(request_id)

    def abort_request(self, request_id: str) -> None:
        self.started.pop(request_id, None)
        super().abort_request(request_id)

    def _handoffs(self, batch: ScheduledBatch, sampled) -> list[Prefilled]:
        out = []
        for request in batch.out_of_cache:
            self.abort_request(request.request_id)
            out.append(
                Prefilled(request, 0, [], error="the prompt does not fit in the prefill cache")
            )
        end = time.time()
        for sample in sampled:
            request = sample.request
            request.token_ids.append(sample.token)
            # leaves the scheduler and the engine, keeping its blocks
            self.scheduler.running.remove(request)
            request.status = RequestStatus.FINISHED
            del self.requests[request.request_id]
            self.detokenizers.pop(request.request_id, None)
            start = self.started.pop(request.request_id, end)
            out.append(
                Prefilled(
                    request,
                    sample.token,
                    list(self.blocks.block_table(request.request_id)),
                    {"prefill_start": start, "prefill_end": end},
                    logprobs=sample.logprobs,
                    cached_tokens=max(0, request.num_cached_tokens),
                )
            )
        return out
