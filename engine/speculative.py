"""Speculative decoding (``EngineConfig.speculative_tokens`` k > 0; off at 0): a decode
step verifies up to k guessed tokens of a request at once, guessed by a ``Guesser``
(engine/guessers.py: prompt lookup, ``propose`` here, or suffix decoding).

Drafting (``propose``, each step, for each running request past its prompt that asks
for no logprobs, guide or penalty): the latest earlier place where the request's
last g tokens (g = ``MAX_NGRAM`` down to 1) occur in its prompt and output, within the
last ``WINDOW`` tokens; the draft is the up to k tokens that followed there, capped so
the request cannot pass ``max_tokens`` or the context. Code edits, quotes and
summaries repeat their input, and there the guesses hold.

Verification (``ModelRunner.run``): the request's pending token and its draft d1..dk
go through the decode path as k + 1 rows of one request, positions p .. p + k, each row
attending to the cache up to its own position (each is a sequence of one query token
over the same block table, its KV written before any row attends: the decode kernels'
order), so the weights are read once for all k + 1. Row j's greedy token t_j is the
output at p + j + 1; the draft holds while d_{j+1} == t_j. With a accepted, the tokens
t_0 .. t_a are the output (the same a plain greedy run gives, token for token), the KV of
positions p .. p + a stands and ``num_computed_tokens`` is p + a + 1; the rejected
positions' KV is overwritten later (the blocks stay in the table for the tokens to come).

A sampled request's t_j is drawn from row j as the plain request draws its output at
that position (``Sampler.verify``: the same filtered distribution, a seeded request's
generator keyed by the same seed and position), stopping at the first t_j != d_{j+1}.
This is rejection sampling for a draft that proposes one token: the guess d is accepted
with probability p(d) = min(1, p(d) / q(d)) for q the point mass on d, and a rejected
position's token is p's draw given that it is not d, the residual (p - q)+ normalized;
so every output token has the target's distribution, and a seeded request's output
is the plain run's, token for token, whatever the batch drafted.

Length (``draft_length``): each request's recent share of accepted guesses
(``Guesses.rate``) decides how many guesses pay for the rows that verify them; a request
whose guesses do not pay stops guessing, and tries one again after ``PROBE_EVERY``
steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pdserve.engine.request import Request

MAX_NGRAM = 3
WINDOW = 2048  # tokens searched back for the n-gram
# rows a step verifies at most: past a few rows the CPU decode step's cost grows with
# each one (it is no longer bound by reading the weights: docs/performance.md,
# bench.speculative), so a larger batch drafts fewer guesses per request, or none
ROW_BUDGET = 4
# one more verified row's cost, as a share of a one-row decode step's (bench.speculative
# prints the step's cost by rows: docs/performance.md)
ROW_COST = 0.35
RATE_WEIGHT = 0.3  # how much a verifying step's share of accepted guesses moves the rate
PROBE_EVERY = 16  # steps a request whose guesses did not pay waits before one more try


@dataclass
class Guesses:
    """A request's guesses (``Request.guesses``): ``guessed`` verified and ``accepted``
    so far over ``steps`` verifying steps; ``rate``, the share of its guesses accepted
    lately (each verifying step weighs ``RATE_WEIGHT``; 1 before the first); ``idle``,
    the steps since it last verified any. Written by the model runner's verification
    and the engine's drafting only."""

    guessed: int = 0
    accepted: int = 0
    steps: int = 0
    rate: float = 1.0
    idle: int = 0

    def verified(self, guessed: int, accepted: int) -> None:
        """A step verified ``guessed`` guesses and accepted ``accepted`` of them."""
        self.guessed, self.accepted, self.steps = (
            self.guessed + guessed,
            self.accepted + accepted,
            self.steps + 1,
        )
        self.rate += RATE_WEIGHT * (accepted / guessed - self.rate)
        self.idle = 0


def draft_length(guesses: Guesses, k: int) -> int:
    """How many guesses (0 .. ``k``) pay for this request now: the length L that
    maximizes the tokens a step is expected to give, 1 + r + ... + r^L (each guess held
    with its recent rate r, a later one only after the earlier), per the step's cost,
    1 + ``ROW_COST`` * L; 0 (no guess, so none verified) when none beats a plain step.
    A request past ``PROBE_EVERY`` idle steps tries one guess again."""
    if guesses.idle >= PROBE_EVERY:
        return min(1, k)
    best, value, expected = 0, 1.0, 1.0
    for length in range(1, k + 1):
        expected += guesses.rate**length
        if expected / (1 + ROW_COST * length) > value:
            best, value = length, expected / (1 + ROW_COST * length)
    return best


def guesses_per_request(k: int, running: int) -> int:
    """The guesses each of ``running`` requests may verify this step: ``k``, cut so
    that the step's rows (each request's pending token and guesses) stay within
    ``ROW_BUDGET``; 0 (no drafting) once one row each fills it."""
    return max(0, min(k, ROW_BUDGET // max(running, 1) - 1))


def drafts_for(request: Request, k: int, max_context: int) -> bool:
    """Whether ``request`` may be drafted for this step: running past its prompt, with
    nothing that reads every row's distribution (logprobs, a guide, penalties)."""
    p = request.params
    return (
        k > 0
        and request.num_pending_tokens == 1
        and request.num_output_tokens > 0
        and not p.penalized
        and p.logprobs is None
        and p.guide is None
        and request.num_tokens < max_context
    )


def propose(token_ids: list[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last g
    tokens of ``token_ids`` (longest g first); [] when none occurs. The places where
    the last token recurs are found in one vectorized pass over the window (this runs
    for each guessed request every step); only those are compared further back."""
    n = len(token_ids)
    if n < 2 or k < 1:
        return []
    lo = max(0, n - WINDOW)
    # e: where an earlier occurrence would end (its next token starts the draft)
    window = np.asarray(token_ids[lo : n - 1])
    ends = np.flatnonzero(window == token_ids[-1])[::-1] + lo
    best: dict[int, int] = {}  # match length -> the latest end with it
    for e in ends.tolist():
        g = 1
        while g < MAX_NGRAM and e - g >= lo and token_ids[e - g] == token_ids[n - 1 - g]:
            g += 1
        best.setdefault(g, e)
        if g == MAX_NGRAM:
            break
    if not best:
        return []
    e = best[max(best)]
    return token_ids[e + 1 : e + 1 + k]


def verified(request: Request, n: int) -> bool:
    """Whether a scheduled item (``request``, ``n`` tokens) verifies a draft: its pending
    token and every guess (the scheduler may have cut the draft, never split it)."""
    return bool(request.draft) and n == 1 + len(request.draft)


def accepted(draft: list[int], targets: list[int]) -> int:
    """How many of ``draft`` the greedy ``targets`` (one per verified row, len(draft) +
    1) confirm: the longest prefix with draft[j] == targets[j]."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return a
