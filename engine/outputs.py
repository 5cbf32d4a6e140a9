"""What the engine reports per request after a step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprobs:
    """One generated token's log-probability and the most likely alternatives, under
    the model's own distribution: the log-softmax of the raw logits, before penalties,
    temperature, top-k and top-p (vLLM's default; docs/serving.md, "Log-probabilities
    and penalties").

    A prompt token's (``SamplingParams.prompt_logprobs``) is its log-probability given
    the tokens before it, with its ``rank`` (1 + the tokens more likely than it); a
    generated token's has no rank (None).

    Invariants: ``top_ids`` and ``top_logprobs`` have the same length (the request's
    ``SamplingParams.logprobs`` or ``prompt_logprobs``, at most the vocabulary), most
    likely first; a ``token_id`` among the top has the same logprob there. Values are
    float32 numbers.
    """

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int | None = None


@dataclass
class RequestOutput:
    """``logprobs`` (set when the request asked, ``SamplingParams.logprobs``) is of every
    output token this engine sampled, in order; ``new_logprobs`` of ``new_token_ids``.
    ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache (not
    computed for this request). ``index``: which of the request's choices this is
    (``SamplingParams.n``; 0 for the first or only one). ``prompt_logprobs`` (when the
    request asked, ``SamplingParams.prompt_logprobs``): on the request's first output
    only (choice 0's), one entry per prompt token, None for the first. ``error``: set
    (with ``finish_reason`` "abort") when the request ended for a fault of its own, its
    output left its grammar."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None
    logprobs: list[Logprobs] | None = None
    new_logprobs: list[Logprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    index: int = 0
    # speculative decoding: on the request's last output, guessed and accepted tokens
    # and the steps that verified some (engine/speculative.py); (0, 0, 0) without
    guesses: tuple[int, int, int] = (0, 0, 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepFailed(Exception):
    """A step of ``request_ids`` raised (the cause is chained): one request alone, or
    under tensor parallelism, where the ranks may be out of step, every request of it.
    Those requests are still in the engine; the caller fails (aborts) them."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"a step of {len(request_ids)} request(s) failed: {request_ids}")
        self.request_ids = request_ids
