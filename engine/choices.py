"""Several choices of one request (``SamplingParams.n``): its prompt computed once, then
n sequences that share the prompt's KV.

Each choice i >= 1 has an id from the request's admission on (``name``): the caller's
(``add_request(choice_ids=...)``, the router's attempt of that choice, each a request
of its own once forked), else ``choice_id(request_id, i)`` (outputs under the request's
id, with their ``index``). Until it forks it is the engine's only by that id
(``LLMEngine.unforked``): an abort of it then only keeps it from forking; a request
that ends without forking (aborted, failed, out of cache) drops those left (``drop``),
and its caller hears of the named ones (``LLMEngine.orphaned``: the instance fails
them, and the router runs each alone).

The request runs alone until the draw of its first token (``Request.forks_now``); that
draw also takes choices 1 .. n - 1's first tokens from the same logits (``Sampler``:
each as the request would draw alone with seed + i, under the same mask and
penalties). ``fork`` then makes each of those choices a request of its own (with
``parent_id`` the request's unless named), which:

- shares the prompt's full blocks (``BlockManager.fork``: one more reference each, so a
  block is freed when the last choice holding it ends) and gets a copy of the last,
  partial one (``ModelRunner.fork_blocks``, on every tensor-parallel rank): no block a
  choice writes is another's, the block manager's invariant;
- with no block free for that copy, starts waiting instead, its prompt and first token
  recomputed as a preempted request's are (correct, at the cost of the recomputation);
- is from then on a request like any other: scheduled, preempted and recomputed alone,
  its tokens keyed by its own seed and output position; ``LLMEngine.abort_request`` of
  the request ends every choice it forked unnamed.

A hand-off request (engine/prefilled.py) does not fork: its choices' first tokens leave
with it (``Prefilled.choices``), and the decode instance forks them when its KV lands
(``LLMEngine.land``), the prompt's KV sent once. Forking happens before the request's
own first token is appended, since that token may end the request (and free the blocks
the choices share).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def name(engine: LLMEngine, request: Request, choice_ids: Sequence[str]) -> None:
    """Give ``request``'s choices 1 .. n - 1 their ids (``choice_ids``, or its
    ``choice_id``s when empty) and register them as unforked in ``engine``; ValueError
    (nothing registered) for a count that is not n - 1 or an id in use."""
    n, rid = request.params.n, request.request_id
    named = bool(choice_ids)
    ids = list(choice_ids) if named else [choice_id(rid, i) for i in range(1, n)]
    if named and len(ids) != n - 1:
        raise ValueError(f"choice_ids: {len(ids)} ids for n={n}; must be n - 1 = {n - 1}")
    taken = [c for c in ids if engine.owns(c) or c == rid]
    if taken or len(set(ids)) != len(ids):
        raise ValueError(f"choice_ids: {taken or ids} must be distinct ids not in use here")
    request.choice_ids, request.named_choices = list(ids), named
    for c in ids:
        engine.unforked[c] = request


def drop(engine: LLMEngine, request: Request, ended: bool = True) -> None:
    """``request`` forks no more: its unforked ids go. With ``ended`` (it ended before
    its first draw: aborted, failed, out of cache, released), its named ones are
    ``LLMEngine.orphaned``: their caller hears that they will not run here."""
    for c in request.choice_ids:
        if c is not None:
            engine.unforked.pop(c, None)
            if ended and request.named_choices:
                engine.orphaned.append(c)
    request.choice_ids = []


def abort_unforked(engine: LLMEngine, choice: str) -> bool:
    """Keep unforked choice ``choice`` from forking; False when none has that id."""
    request = engine.unforked.pop(choice, None)
    if request is None:
        return False
    request.choice_ids[request.choice_ids.index(choice)] = None
    return True


def fork(engine: LLMEngine, sample: Sample) -> list[Sample]:
    """The requests of ``sample``'s other choices (``Sample.choices``, one per choice of
    the request, aborted ones included), registered in ``engine`` and scheduled; their
    first tokens as samples, to append as any draw."""
    parent = sample.request
    p, done = parent.params, parent.num_computed_tokens
    ids, named = parent.choice_ids, parent.named_choices
    drop(engine, parent, ended=False)
    copies, out = [], []
    for index, (token, logprobs) in enumerate(sample.choices, start=1):
        if ids[index - 1] is None:  # aborted before it forked
            continue
        params = replace(p, n=1, seed=None if p.seed is None else p.seed + index)
        child = Request(
            ids[index - 1],
            parent.prompt_token_ids,
            params,
            parent_id=None if named else parent.request_id,
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
