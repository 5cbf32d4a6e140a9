"""Where speculative decoding's guesses come from (engine/speculative.py verifies them):
a ``Guesser``, chosen by name (``EngineConfig.speculative_method``, the YAML's
``<pool>.speculative.method``).

- ``ngram``: prompt lookup (``speculative.propose``): what followed the latest earlier
  place where the request's last 3, 2 or 1 tokens occur in its own prompt and output.
- ``suffix``: suffix decoding, as Arctic Inference's SuffixDecoding: the longest suffix
  of the request's tokens (up to ``DEPTH``) seen before, in its own tokens or in
  recent requests' outputs, and the continuation seen most often after it, followed
  token by token while one continuation dominates (``SHARE``). Counts of what followed
  each context of 1 .. ``DEPTH`` tokens stand in for the suffix tree: per request over
  its prompt and output, kept up to date as tokens arrive, and over the outputs of
  requests that ended here (at most ``MAX_CONTEXTS`` contexts, least recently seen
  dropped first), so an agent's repeated tool calls and a re-asked question guess
  well across requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import TYPE_CHECKING

from pdserve.engine.speculative import propose

if TYPE_CHECKING:
    from pdserve.engine.request import Request

DEPTH = 8  # the longest context matched
SHARE = 0.5  # a continuation is followed while it has at least this share of its context's
MAX_CONTEXTS = 200_000  # contexts the cross-request counts keep


class Guesser(ABC):
    """Contract: ``guess(request, k)`` returns at most ``k`` tokens guessed to follow the
    request's tokens (prompt and output), [] when it has none; ``ended(request)`` says a
    request left the engine (finished or aborted: its tokens may inform later guesses,
    and nothing of it is kept past what it contributed). Both run on the engine's step
    loop only; neither changes the request."""

    name: str

    @abstractmethod
    def guess(self, request: Request, k: int) -> list[int]: ...

    @abstractmethod
    def ended(self, request: Request) -> None: ...


class PromptLookup(Guesser):
    name = "ngram"

    def guess(self, request: Request, k: int) -> list[int]:
        return propose(request.token_ids, k)

    def ended(self, request: Request) -> None:
        """Nothing is kept: each guess reads the request's own tokens."""


Counts = dict[tuple[int, ...], dict[int, int]]  # context -> next token -> times seen


def count(counts: Counts, tokens: list[int], start: int) -> None:
    """Count what follows each context of 1 .. DEPTH tokens ending before positions
    ``start`` .. ``len(tokens) - 1`` of ``tokens``."""
    for i in range(max(start, 1), len(tokens)):
        nxt = tokens[i]
        for n in range(1, min(DEPTH, i) + 1):
            after = counts.setdefault(tuple(tokens[i - n : i]), {})
            after[nxt] = after.get(nxt, 0) + 1


class SuffixDecoding(Guesser):
    name = "suffix"

    def __init__(self) -> None:
        self.own: dict[str, tuple[Counts, int]] = {}  # request id -> counts, tokens counted
        self.seen: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    def guess(self, request: Request, k: int) -> list[int]:
        counts, done = self.own.get(request.request_id, ({}, 0))
        tokens = request.token_ids
        count(counts, tokens, done)
        self.own[request.request_id] = (counts, len(tokens))
        context, out = tokens[-DEPTH:], []
        while len(out) < k:
            nxt = self._next(counts, context)
            if nxt is None:
                break
            out.append(nxt)
            context = [*context, nxt][-DEPTH:]
        return out

    def _next(self, counts: Counts, context: list[int]) -> int | None:
        """The continuation of the longest suffix of ``context`` seen before, here or
        across requests (their counts summed), when it has ``SHARE`` of what followed."""
        for n in range(min(DEPTH, len(context)), 0, -1):
            key = tuple(context[-n:])
            mine, theirs = counts.get(key), self.seen.get(key)
            if not mine and not theirs:
                continue
            after = dict(theirs or {})
            if theirs is not None:
                self.seen.move_to_end(key)
            for t, c in (mine or {}).items():
                after[t] = after.get(t, 0) + c
            best = max(after, key=after.__getitem__)
            return best if after[best] >= SHARE * sum(after.values()) else None
        return None

    def ended(self, request: Request) -> None:
        self.own.pop(request.request_id, None)
        lead = min(DEPTH, request.num_prompt_tokens)  # the prompt's end, as context
        output = request.token_ids[request.num_prompt_tokens - lead :]
        fresh: Counts = {}
        count(fresh, output, lead)
        for key, after in fresh.items():
            mine = self.seen.setdefault(key, {})
            self.seen.move_to_end(key)
            for t, c in after.items():
                mine[t] = mine.get(t, 0) + c
        while len(self.seen) > MAX_CONTEXTS:
            self.seen.popitem(last=False)


GUESSERS: dict[str, type[Guesser]] = {g.name: g for g in (PromptLookup, SuffixDecoding)}


def make_guesser(name: str) -> Guesser:
    """The guesser called ``name``; ValueError naming the known ones."""
    if name not in GUESSERS:
        raise ValueError(f"speculative_method={name!r}: allowed values are {', '.join(GUESSERS)}")
    return GUESSERS[name]()
