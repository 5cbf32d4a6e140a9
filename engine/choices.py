"""Several choices of one request (``SamplingParams.n``): its prompt computed once, then
n sequences that share the prompt's KV.

The request runs alone until the draw of its first token (``Request.forks_now``); that
draw also takes choices 1 .. n - 1's first tokens from the same logits (``Sampler``:
each as the request would draw alone with seed + i, under the same mask and
penalties). ``fork`` then makes each of those choices a request of its own, id
``choice_id(request_id, i)`` and ``parent_id`` the request's, which:

- shares the prompt's full blocks (``BlockManager.fork``: one more reference each, so a
  block is freed when the last choice holding it ends) and gets a copy of the last,
  partial one (``ModelRunner.fork_blocks``, on every tensor-parallel rank): no block a
  choice writes is another's, the block manager's invariant;
- with no block free for that copy, starts waiting instead, its prompt and first token
  recomputed as a preempted request's are (correct, at the cost of the recomputation);
- is from then on a request like any other: scheduled, preempted and recomputed alone,
  its tokens keyed by its own seed and output position; its outputs carry the
  request's id and their ``index``; ``LLMEngine.abort_request`` of the request ends
  every choice.

Forking happens before the request's own first token is appended, since that token may
end the request (and free the blocks the choices share).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sample

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

SEPARATOR = "\x1f"  # the unit separator: no client's request id holds it (printable ids)


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of choice ``index`` (>= 1) of request ``request_id``."""
    return f"{request_id}{SEPARATOR}{index}"


def fork(engine: LLMEngine, sample: Sample) -> list[Sample]:
    """The requests of ``sample``'s other choices (``Sample.choices``), registered in
    ``engine`` and scheduled; their first tokens as samples, to append as any draw."""
    parent = sample.request
    p, done = parent.params, parent.num_computed_tokens
    copies, out = [], []
    for index, (token, logprobs) in enumerate(sample.choices, start=1):
        params = replace(p, n=1, seed=None if p.seed is None else p.seed + index)
        child = Request(
            choice_id(parent.request_id, index),
            parent.prompt_token_ids,
            params,
            parent_id=parent.request_id,
            index=index,
        )
        child.prompt_logprobs = None  # the request's first output carries them
        child.num_cached_tokens = parent.num_cached_tokens
        if params.guide is not None:
            child.matcher = engine.grammars().matcher(params.guide)
        if engine.tokenizer is not None:
            engine.detokenizers[child.request_id] = Detokenizer(engine.tokenizer, params.stop)
        engine.requests[child.request_id] = child
        try:
            pair = engine.blocks.fork(parent.request_id, child.request_id, done)
        except RuntimeError:  # no block for the partial one: recomputed, as if preempted
            engine.scheduler.waiting.appendleft(child)
        else:
            if pair is not None:
                copies.append(pair)
            child.num_computed_tokens, child.status = done, RequestStatus.RUNNING
            engine.scheduler.running.append(child)
        out.append(Sample(child, token, logprobs))
    engine.runner.fork_blocks(copies)
    return out
