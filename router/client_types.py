"""What ``RouterClient`` (router/client.py) sends and gives back, as plain types:
``make_request`` builds a protobuf ``GenerateRequest``; ``read_chunk`` reads one
``GenerateResponse`` as a ``Chunk`` (the last one with usage and ``Timings``; each with
its tokens' ``TokenLogprobs`` when the request asked, ``logprobs=N``), which
``Completion`` adds up."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.router import pdserve_pb2 as pb


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability under the model's distribution (the
    log-softmax of its raw logits, before penalties and temperature) and the
    alternatives': ``top_ids`` most likely first, ``top_logprobs`` one per id. A prompt
    token's also has its ``rank`` (1 + the tokens more likely; None for an output token)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int | None = None


@dataclass
class Timings:
    queue_ms: float
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    instances: list[str]
    kv_bytes: int = 0  # disaggregated: KV moved from the prefill to the decode instance
    kv_cached_tokens: int = 0  # disaggregated: prompt tokens whose KV decode held (not sent)
    transfer_ms: float = 0.0
    attempts: int = 1
    # ms since arrival: queued, prefill_start/end, transfer_start/end, decode_start,
    # finish (0: not applicable), and tokens (one entry per token)
    phases: dict = field(default_factory=dict)
    # speculative decoding: guessed tokens verified, those accepted, the steps verifying
    guessed_tokens: int = 0
    accepted_tokens: int = 0
    guess_steps: int = 0


@dataclass
class Chunk:
    """New tokens and text since the previous chunk; the last one has finish_reason."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (last chunk)
    timings: Timings | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    # first chunk only, when the request asked (prompt_logprobs=N): one per prompt token
    # after the first
    prompt_logprobs: list[TokenLogprobs] | None = None

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
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    timings: Timings | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # the first chunk's

    def add(self, chunk: Chunk) -> None:
        self.request_id = chunk.request_id
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.token_ids += chunk.token_ids
        self.text += chunk.text
        if chunk.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs += chunk.logprobs
        if chunk.finished:
            self.finish_reason, self.timings = chunk.finish_reason, chunk.timings
            self.prompt_tokens = chunk.prompt_tokens
            self.completion_tokens = chunk.completion_tokens
            self.cached_tokens = chunk.cached_tokens


def read_chunk(msg: pb.GenerateResponse) -> Chunk:
    """One response message as a ``Chunk`` (its ``logprobs`` None when it carries none)."""
    c = Chunk(msg.request_id, list(msg.token_ids), msg.text)
    if msg.logprobs:
        c.logprobs = [
            TokenLogprobs(t.token_id, t.logprob, tuple(t.top_ids), tuple(t.top_logprobs))
            for t in msg.logprobs
        ]
    if msg.prompt_logprobs:
        c.prompt_logprobs = [
            TokenLogprobs(t.token_id, t.logprob, tuple(t.top_ids), tuple(t.top_logprobs), t.rank)
            for t in msg.prompt_logprobs
        ]
    if msg.finish_reason:
        t = msg.timings
        c.finish_reason = msg.finish_reason
        c.prompt_tokens, c.completion_tokens = msg.usage.prompt_tokens, msg.usage.completion_tokens
        c.cached_tokens = msg.usage.cached_tokens
        phases = {f.name: v for f, v in t.phases.ListFields()}
        phases["tokens"] = list(t.phases.tokens)
        c.timings = Timings(
            t.queue_ms,
            t.ttft_ms,
            t.tpot_ms,
            t.e2e_ms,
            list(t.instances),
            kv_bytes=t.kv_bytes,
            kv_cached_tokens=t.kv_cached_tokens,
            transfer_ms=t.transfer_ms,
            attempts=t.attempts,
            phases=phases,
            guessed_tokens=t.guessed_tokens,
            accepted_tokens=t.accepted_tokens,
            guess_steps=t.guess_steps,
        )
    return c


def make_request(
    prompt: str | None = None,
    *,
    messages: list[dict] | None = None,
    prompt_token_ids: list[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] | str = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    logprobs: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    structured_outputs: Mapping[str, Any] | None = None,
    prompt_logprobs: int | None = None,
) -> pb.GenerateRequest:
    """A ``GenerateRequest``: exactly one of prompt, messages, prompt_token_ids.
    ``logprobs=N`` (0-20) has every chunk carry its tokens' ``TokenLogprobs`` with N
    alternatives; the penalties are OpenAI's (presence, frequency) and vLLM's
    (repetition); ``structured_outputs``: what the output must match, as vLLM's field
    says it: one of ``{"json": schema}`` (a dict or its JSON text), ``{"regex": r}``,
    ``{"choice": [strings]}``, ``{"grammar": lark_text}``; ``prompt_logprobs=N`` (0-20)
    has the first chunk carry the prompt's ``TokenLogprobs`` (vLLM's prompt_logprobs);
    None leaves a field unset (the engine's default)."""
    given = [x is not None for x in (prompt, messages, prompt_token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
    req = pb.GenerateRequest(request_id=request_id)
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.SetInParent()  # set even when empty, so the router says what is wrong
        req.messages.messages.extend(pb.ChatMessage(**m) for m in messages)
    else:
        req.prompt_token_ids.SetInParent()
        req.prompt_token_ids.ids.extend(prompt_token_ids)
    s = req.sampling
    for name, value in dict(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        logprobs=logprobs,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        prompt_logprobs=prompt_logprobs,
    ).items():
        if value is not None:
            setattr(s, name, value)
    s.stop.extend([stop] if isinstance(stop, str) else stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    if structured_outputs is not None:
        if len(structured_outputs) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar")
        [(kind, spec)] = structured_outputs.items()
        s.guide.kind = kind
        s.guide.spec = spec if isinstance(spec, str) else json.dumps(spec)
    return req
