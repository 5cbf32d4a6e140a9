"""What ``RouterClient`` (router/client.py) hands back: each ``Chunk`` of a stream, the
``Completion`` they add up to, the final ``Timings``, and per token ``TokenLogprobs``
when the request asked (``logprobs=N``); read from ``pdserve.v1.GenerateResponse``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router import pdserve_pb2 as pb


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability under the model's distribution (the
    log-softmax of its raw logits, before penalties and temperature) and the
    alternatives': ``top_ids`` most likely first, ``top_logprobs`` one per id."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass
class Timings:
    queue_ms: float
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    instances: list[str]
    kv_bytes: int = 0  # disaggregated: KV moved from the prefill to the decode instance
    transfer_ms: float = 0.0
    attempts: int = 1
    # ms since arrival: queued, prefill_start/end, transfer_start/end, decode_start,
    # finish (0: not applicable), and tokens (one entry per token)
    phases: dict = field(default_factory=dict)


@dataclass
class Chunk:
    """New tokens and text since the previous chunk; the last one has finish_reason."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token when the request asked

    def add(self, chunk: Chunk) -> None:
        self.request_id = chunk.request_id
        self.token_ids += chunk.token_ids
        self.text += chunk.text
        if chunk.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs += chunk.logprobs
        if chunk.finished:
            self.finish_reason, self.timings = chunk.finish_reason, chunk.timings
            self.prompt_tokens = chunk.prompt_tokens
            self.completion_tokens = chunk.completion_tokens


def chunk_of(msg: pb.GenerateResponse) -> Chunk:
    """One response message as a ``Chunk`` (its ``logprobs`` None when it carries none)."""
    c = Chunk(msg.request_id, list(msg.token_ids), msg.text)
    if msg.logprobs:
        c.logprobs = [
            TokenLogprobs(t.token_id, t.logprob, tuple(t.top_ids), tuple(t.top_logprobs))
            for t in msg.logprobs
        ]
    if msg.finish_reason:
        t = msg.timings
        c.finish_reason = msg.finish_reason
        c.prompt_tokens, c.completion_tokens = msg.usage.prompt_tokens, msg.usage.completion_tokens
        phases = {f.name: v for f, v in t.phases.ListFields()}
        phases["tokens"] = list(t.phases.tokens)
        c.timings = Timings(
            t.queue_ms,
            t.ttft_ms,
            t.tpot_ms,
            t.e2e_ms,
            list(t.instances),
            t.kv_bytes,
            t.transfer_ms,
            t.attempts,
            phases,
        )
    return c
