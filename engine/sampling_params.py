"""Per-request sampling settings, validated at construction: whatever a request
carries either fits here or is refused with the field, the value and what is allowed,
so that no value reaches a step that could make it raise (a batch is shared)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.engine.structured import Guide, GuideError

# the smallest temperature that divides float32 logits without overflowing them to inf;
# below it (0 excepted: greedy) a request is refused rather than sampled as greedy
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows (top_logprobs)
MAX_CHOICES = 16  # n: sequences per request
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty: OpenAI's range
# repetition_penalty: a positive factor; the bounds keep penalized float32 logits finite
REPETITION_RANGE = (0.01, 100.0)


@dataclass
class SamplingParams:
    """What vLLM users expect: temperature 0 is greedy; top_k 0 or -1 means no top-k cut.

    ``logprobs``: None computes none; N in [0, MAX_LOGPROBS] reports, for every generated
    token, its log-probability and the N most likely tokens' (docs/serving.md,
    "Log-probabilities and penalties"). Penalties (off at their defaults):
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, over the output tokens so
    far) and ``repetition_penalty`` (vLLM's / HF's, over prompt + output tokens).
    ``prompt_logprobs``: None computes none; N in [0, MAX_LOGPROBS] reports, for every
    prompt token after the first, its log-probability given the tokens before it, its
    rank and the N most likely tokens' (vLLM's ``prompt_logprobs``; computed in the
    prefill pass, so such a request does not start from the prefix cache).
    ``n``: the sequences (choices) to generate from the prompt, 1 to MAX_CHOICES: its
    KV is computed once and shared (engine/choices.py); with a ``seed``, choice i draws as
    the request would alone with seed + i.
    ``guide``: None, or the grammar the output must match (engine/structured.py; a dict
    of its fields is taken too, as the instances' feed carries it).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    guide: Guide | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        if isinstance(self.guide, dict):
            try:
                self.guide = Guide(**self.guide)
            except TypeError as e:
                raise GuideError(f"guide={self.guide!r}: {e}") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        if not _integer(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n={self.n!r}: must be an integer in [1, {MAX_CHOICES}]")
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an integer >= 1")
        t = self.temperature
        if not _number(t) or not math.isfinite(t) or math.copysign(1, t) < 0:
            raise ValueError(f"temperature={t!r}: must be a finite number >= 0 (0 is greedy)")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={t!r}: must be 0 (greedy) or at least {MIN_TEMPERATURE:g}"
            )
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not _integer(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k={self.top_k!r}: must be an integer >= -1 (0 and -1 disable it)"
            )
        if any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: stop strings must not be empty")
        for key in ("logprobs", "prompt_logprobs"):
            value = getattr(self, key)
            if value is not None and (not _integer(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{key}={value!r}: must be unset or an integer in "
                    f"[0, {MAX_LOGPROBS}] (the alternatives reported per token)"
                )
        for key in ("presence_penalty", "frequency_penalty"):
            _check_range(key, getattr(self, key), PENALTY_RANGE, "0 is off")
        _check_range("repetition_penalty", self.repetition_penalty, REPETITION_RANGE, "1 is off")
        if self.guide is not None and not isinstance(self.guide, Guide):
            raise ValueError(f"guide={self.guide!r}: must be None or a Guide")

    def as_dict(self) -> dict:
        """Plain data (lists, numbers, strings, a dict for the guide): what a wire
        carries; ``SamplingParams(**d)`` reads it back."""
        d = dict(self.__dict__)
        d["guide"] = None if self.guide is None else self.guide.as_dict()
        return d

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits before the choice."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def _check_range(key: str, value, bounds: tuple[float, float], off: str) -> None:
    low, high = bounds
    if not _number(value) or not low <= value <= high:  # NaN fails the comparison too
        raise ValueError(f"{key}={value!r}: must be a number in [{low:g}, {high:g}] ({off})")


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
