"""Structured output: a request's grammar (``Guide``) and the matchers that hold its
generated tokens to it, as a token mask in the sampler (docs/serving.md, "Structured
outputs").

The grammar library is llguidance (docs/serving.md says why): its matcher computes the
mask of the tokens the grammar allows next from the state its consumed tokens left
(its cost: docs/performance.md, ``bench.structured``), with no per-schema
precomputation over the vocabulary.

Invariants:
- A ``Guide`` is plain data (what a request carries over every wire); its ``grammar()``
  is the llguidance grammar text, the same on every process, so a matcher built on the
  decode instance from the delivered tokens is the prefill instance's, token for token.
- ``Grammars.matcher(guide)`` is a fresh matcher at the grammar's start: a copy of the
  one compiled for that guide (compiled once per guide, at most ``CACHE`` kept).
- Compilation and each mask are bounded by ``LIMITS`` (llguidance's fuel: work, not
  time), so a request's grammar cannot stall the step loop it shares.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    import torch

KINDS = ("json", "regex", "choice", "grammar")
CACHE = 64  # compiled guides kept per process
# a compact JSON layout, as ``json.dumps`` writes it; no free whitespace, so a model
# cannot pad an object forever
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, max_grammar_size=500_000)


class GuideError(ValueError):
    """A guide that cannot be compiled; the message names what is wrong."""


@dataclass(frozen=True)
class Guide:
    """What a request's output must match:

    - ``json``: ``spec`` is a JSON schema (JSON text; ``{"type": "object"}`` for any
      object, OpenAI's ``json_object``);
    - ``regex``: ``spec`` is a regular expression (Rust ``regex`` syntax) the whole
      output matches;
    - ``choice``: ``spec`` is a JSON list of strings, the output is one of them;
    - ``grammar``: ``spec`` is a Lark grammar (llguidance's dialect, ``start`` rule).
    """

    kind: str
    spec: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GuideError(f"guide.kind={self.kind!r}: must be one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str) or not self.spec:
            raise GuideError(f"guide.spec={self.spec!r}: must be a non-empty string")

    def grammar(self) -> str:
        """The llguidance grammar text of this guide; GuideError for a spec that is not
        one (a schema that is not a JSON object, choices that are not strings)."""
        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise GuideError(f"json schema: not valid JSON ({e})") from None
            if not isinstance(schema, dict):
                raise GuideError("json schema: must be a JSON object")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
            except ValueError as e:
                raise GuideError(f"json schema: {e}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except ValueError:
                choices = None
            if not (
                isinstance(choices, list)
                and choices
                and all(isinstance(c, str) and c for c in choices)
            ):
                raise GuideError(f"choice: {self.spec[:80]!r} must be a list of non-empty strings")
            # a Lark string literal is a JSON string
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        return llguidance.LLMatcher.grammar_from_lark(self.spec)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "spec": self.spec}


def llg_tokenizer(tokenizer, vocab_size: int):
    """An llguidance tokenizer over an engine ``Tokenizer`` (engine/tokenizer.py: its
    backend and end-of-sequence ids), ``vocab_size`` wide (the model's logits, which may
    be wider than the vocabulary): what the engine, the router and the benchmarks all
    build their ``Grammars`` on."""
    return llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids)
    )


class Grammars:
    """One process's compiled guides over one tokenizer. Thread-safe: the router's
    intake threads and an instance's feed thread compile, the step loop copies."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # an llguidance.LLTokenizer (``llg_tokenizer``)
        self.limits = llguidance.LLParserLimits(**LIMITS, verbose_errors=False)
        self._compiled: OrderedDict[Guide, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, guide: Guide) -> llguidance.LLMatcher:
        """The matcher at the start of ``guide``'s grammar, kept for the next requests
        (do not advance it: ``matcher`` copies it); GuideError when it does not compile."""
        with self._lock:
            found = self._compiled.get(guide)
            if found is not None:
                self._compiled.move_to_end(guide)
                return found
        grammar = guide.grammar()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GuideError(f"{guide.kind}: {matcher.get_error()[:300]}")
        with self._lock:
            self._compiled[guide] = matcher
            while len(self._compiled) > CACHE:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, guide: Guide, consumed: tuple[int, ...] = ()) -> Matcher:
        """A fresh matcher of ``guide`` that has consumed ``consumed`` (a resumed
        request's delivered tokens); GuideError when they do not fit the grammar."""
        m = Matcher(self.compile(guide).deep_copy())
        if consumed and not m.inner.consume_tokens(list(consumed)):
            raise GuideError(
                f"delivered: its tokens do not fit the {guide.kind} guide "
                f"({m.inner.get_error()[:200]})"
            )
        return m


class Matcher:
    """One request's place in its grammar. Written only by the engine's step loop:
    ``fill`` or ``allows`` before the request's draw, ``consume`` after it."""

    def __init__(self, inner: llguidance.LLMatcher):
        self.inner = inner

    def fill(self, row: torch.Tensor) -> None:
        """Write the tokens the grammar allows next into ``row`` (int32 [ceil(V / 32)],
        contiguous, V the tokenizer's ``n_vocab``): token t at bit t % 32 of word t // 32.
        Once the grammar is complete (or dead), only the end-of-sequence tokens."""
        assert str(row.dtype) == "torch.int32" and row.is_contiguous()
        self.inner.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def allows(self, token: int) -> bool:
        """The grammar allows ``token`` next (its bit in ``fill``'s mask), without the
        mask."""
        return self.inner.validate_tokens([token]) == 1

    def consume(self, token: int) -> None:
        self.inner.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        return self.inner.is_stopped() and not self.inner.is_error()

    @property
    def error(self) -> str | None:
        """Why the output left the grammar (a dead end), or None."""
        return self.inner.get_error() or None if self.inner.is_error() else None
