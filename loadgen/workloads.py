"""Request generators for the goodput benchmark: what is asked (prompt tokens, output
length, from a real dataset) and when (arrival times at a rate), with a fixed seed.

    tokenizer, max_len = model_info("smollm2-135m")
    spec = WorkloadSpec("sharegpt", seed=0, max_prompt_tokens=256)
    for arrival_s, prompt_ids, output_len in make_workload(spec, tokenizer, 100, 2.0, max_len):
        ...

Workloads (``WORKLOADS``):
- ``sharegpt``: a conversation's first human turn is the prompt, the token count of the
  model answer after it the output length (as vLLM's benchmark_serving); pairs with
  fewer than 4 prompt or output tokens are dropped, as there.
- ``humaneval``: the problem's prompt; output length = its canonical solution's tokens.
- ``longprompt``: prompts of ``long_prompt_mean`` tokens on average (0.5x-1.5x, uniform)
  cut from ShareGPT text, outputs of ``long_output_mean`` tokens on average (same
  spread): prefill-heavy.
- ``trace``: a JSONL file (``loadgen.datasets.read_trace``); its arrival times are kept,
  rescaled to the asked rate.
- ``sharedprefix``: long system prompts shared by many short questions
  (``loadgen.sharedprefix``).
- ``azure``, ``mooncake``: a window of a production trace (the Azure LLM inference
  trace 2023's CSV, a Mooncake JSONL trace) replayed with its own arrivals, scaled in
  time (``time_scale``) and tokens (``token_scale``), Mooncake's shared prefixes kept
  (``loadgen.trace_replay``); one pace, so ``n`` and the rate are not used, except that an
  infinite rate asks for a warm-up of ``n`` requests.
- ``multiturn``: ShareGPT conversations turn by turn, closed-loop: not a list of
  ``Request`` but of ``loadgen.multiturn.Conversation`` (``make_conversations``), replayed
  by ``loadgen.chat_replay``.

Every request is cut to fit: the length scales and caps of the spec apply, then a
request whose prompt + output exceeds the model's context is dropped (sharegpt,
humaneval) or its prompt shortened (longprompt, trace). Every workload draws its
sample with the rate in the seed (``sample_seed``): a later rate of a sweep must not
find an earlier one's prompts in the prefix cache, nor the runs their warm-up's (drawn
at an infinite rate). The same spec, seed, count and rate give the same requests, so
contenders of ``pdserve compare`` measured at one rate get the same ones. A trace keeps
its lengths and arrivals at every rate; the text filling its ``prompt_len`` entries is
what changes (prompts given as text repeat, as do humaneval's 164 problems).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.loadgen import datasets

PRODUCTION_TRACES = ("azure", "mooncake")  # replayed by loadgen.trace_replay
OPEN_LOOP = ("sharegpt", "humaneval", "longprompt", "trace", "sharedprefix")  # at a rate
WORKLOADS = (*OPEN_LOOP, "multiturn", *PRODUCTION_TRACES)
WHOLE_PROMPTS = ("sharedprefix", "multiturn")  # prompts built whole: no prompt_scale
TRACE_DEFAULTS = {"time_scale": 1.0, "token_scale": 1.0, "trace_start_s": 0.0}
MIN_TOKENS = 4  # vLLM's filter for ShareGPT pairs


class Request(NamedTuple):
    arrival_s: float  # seconds after the start of the run
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class WorkloadSpec:
    name: str = "sharegpt"
    seed: int = 0
    burstiness: float = 1.0  # Gamma shape: 1 is Poisson, < 1 burstier, > 1 more regular
    prompt_scale: float = 1.0  # multiply prompt lengths (then cap)
    output_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    long_prompt_mean: int = 1500
    long_output_mean: int = 90
    trace: str | None = None
    dataset_limit: int | None = None  # read only the first N ShareGPT conversations
    system_prompts: int = 8  # sharedprefix: distinct system prompts
    system_prompt_tokens: int = 750  # sharedprefix: their mean length
    max_turns: int = 5  # multiturn: turns of a conversation at most
    think_time_s: float = 5.0  # multiturn: mean pause between an answer and the next turn
    time_scale: float = 1.0  # azure, mooncake: every arrival gap multiplied by this
    token_scale: float = 1.0  # azure, mooncake: prompt and output lengths multiplied by this
    trace_start_s: float = 0.0  # azure, mooncake: the window's start, trace seconds
    trace_duration_s: float | None = None  # its length, trace seconds (None: to the end)

    def __post_init__(self):
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r}: expected one of {', '.join(WORKLOADS)}")
        if self.name in ("trace", *PRODUCTION_TRACES) and not self.trace:
            raise ValueError(f"workload {self.name}: give the trace file (--trace)")
        self._check_trace_replay()
        if self.burstiness <= 0 or self.prompt_scale <= 0 or self.output_scale <= 0:
            raise ValueError("burstiness and the length scales must be > 0")
        if self.name in WHOLE_PROMPTS and self.prompt_scale != 1.0:
            raise ValueError(
                f"prompt_scale {self.prompt_scale:g}: workload {self.name} builds its prompts "
                "whole; only 1 is allowed (cap them with max_prompt_tokens)"
            )
        for key in ("system_prompts", "system_prompt_tokens", "max_turns"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} {getattr(self, key)}: must be >= 1")
        if self.think_time_s < 0:
            raise ValueError(f"think_time_s {self.think_time_s:g}: must be >= 0")

    def _check_trace_replay(self) -> None:
        if self.name not in PRODUCTION_TRACES:
            for key, default in (*TRACE_DEFAULTS.items(), ("trace_duration_s", None)):
                if getattr(self, key) != default:
                    raise ValueError(
                        f"{key} {getattr(self, key)}: only for workloads "
                        f"{', '.join(PRODUCTION_TRACES)}, not {self.name}"
                    )
            return
        for key in ("time_scale", "token_scale"):
            value = getattr(self, key)
            if not (0 < value < math.inf):
                raise ValueError(f"{key} {value}: must be a finite number > 0")
        if not (0 <= self.trace_start_s < math.inf):
            raise ValueError(f"trace_start_s {self.trace_start_s}: must be >= 0 (seconds)")
        if self.trace_duration_s is not None and not (0 < self.trace_duration_s < math.inf):
            raise ValueError(f"trace_duration_s {self.trace_duration_s}: must be > 0 (seconds)")
        for key in ("prompt_scale", "output_scale", "burstiness"):
            if getattr(self, key) != 1.0:
                raise ValueError(
                    f"{key} {getattr(self, key):g}: workload {self.name} keeps the trace's "
                    "arrivals and scales lengths by token_scale; only 1 is allowed"
                )


def model_info(model: str):
    """(tokenizer, context length) of a model alias or HF folder."""
    from pdserve.engine.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(model)
    if checkpoint.tokenizer is None:
        raise ValueError(f"{model}: has no tokenizer")
    return checkpoint.tokenizer, checkpoint.config.max_position


def sample_seed(seed: int, rate: float) -> str:
    """The seed of one run's sample: the spec's seed and the rate (``repr`` of the float:
    exact, and 8 and 8.0 are one rate)."""
    return f"{seed}-{float(rate)!r}"


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n arrival times from 0: Gamma gaps of mean 1/rate and shape ``burstiness``
    (exponential gaps, a Poisson process, at 1); all at 0 for an infinite rate."""
    if rate <= 0:
        raise ValueError(f"rate {rate}: must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}-arrivals")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def make_workload(
    spec: WorkloadSpec, tokenizer, n: int, rate: float, max_model_len: int
) -> list[Request]:
    """n requests arriving at ``rate`` per second (on average); ``azure``, ``mooncake``:
    the trace window's requests (n and rate unused), or at an infinite rate n warm-up
    requests (``loadgen.trace_replay``)."""
    if spec.name == "multiturn":
        raise ValueError(
            "workload multiturn is closed-loop: loadgen.multiturn.make_conversations makes it"
        )
    if spec.name == "sharedprefix":
        from pdserve.loadgen.sharedprefix import shared_prefix_requests

        return shared_prefix_requests(spec, tokenizer, n, rate, max_model_len)
    if spec.name == "trace":
        return _trace(spec, tokenizer, n, rate, max_model_len)
    if spec.name in PRODUCTION_TRACES:
        from pdserve.loadgen.trace_replay import trace_requests, warmup_requests

        if math.isinf(rate):
            return warmup_requests(spec, tokenizer, n, max_model_len)
        return trace_requests(spec, tokenizer, max_model_len)
    samples = sample_requests(spec, tokenizer, n, max_model_len, rate)
    times = arrival_times(n, rate, spec.burstiness, spec.seed)
    return [Request(t, ids, out) for t, (ids, out) in zip(times, samples, strict=True)]


def sample_requests(
    spec: WorkloadSpec, tokenizer, n: int, max_model_len: int, rate: float | None = None
) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs of a dataset workload: the sample of a
    run at ``rate`` (``sample_seed``), or with None the spec's seed alone (a sample of
    the workload, for a planner or a tool that sends it once)."""
    if spec.name in (*WHOLE_PROMPTS, *PRODUCTION_TRACES):
        raise ValueError(f"workload {spec.name}: its requests come whole, not as pairs")
    rng = random.Random(spec.seed if rate is None else sample_seed(spec.seed, rate))
    if spec.name == "longprompt":
        return _longprompt(spec, tokenizer, n, max_model_len, rng)
    if spec.name == "sharegpt":
        pairs = list(datasets.sharegpt_pairs(spec.dataset_limit))
    else:
        pairs = datasets.humaneval_pairs()
    out: list[tuple[list[int], int]] = []
    for prompt, answer in shuffled_cycle(pairs, rng, n):
        ids, answer_len = tokenizer.encode(prompt), len(_text_ids(tokenizer, answer))
        if spec.name == "sharegpt" and (len(ids) < MIN_TOKENS or answer_len < MIN_TOKENS):
            continue
        ids, out_len = _scaled(spec, ids, answer_len)
        if len(ids) + out_len <= max_model_len:
            out.append((ids, out_len))
            if len(out) == n:
                return out
    raise ValueError(f"{spec.name}: fewer than {n} requests fit a context of {max_model_len}")


def shuffled_cycle(items: list, rng: random.Random, n: int) -> Iterator:
    """The items in a seeded order, again in another order as long as needed (at most
    ``n`` passes: a pass may drop every item)."""
    if not items:
        raise ValueError("the dataset is empty")
    for _ in range(max(n, 1)):
        order = list(items)
        rng.shuffle(order)
        yield from order


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def _scaled(spec: WorkloadSpec, ids: list[int], out_len: int) -> tuple[list[int], int]:
    n = max(1, round(len(ids) * spec.prompt_scale))
    if spec.max_prompt_tokens:
        n = min(n, spec.max_prompt_tokens)
    ids = (ids * math.ceil(n / len(ids)))[:n]
    out_len = max(1, round(out_len * spec.output_scale))
    if spec.max_output_tokens:
        out_len = min(out_len, spec.max_output_tokens)
    return ids, out_len


def token_pool(tokenizer, needed: int, rng: random.Random, limit: int | None) -> list[int]:
    """At least ``needed`` tokens of ShareGPT text (prompts and answers, in a seeded order)."""
    pool: list[int] = []
    for prompt, answer in shuffled_cycle(list(datasets.sharegpt_pairs(limit)), rng, needed):
        pool += _text_ids(tokenizer, prompt + "\n" + answer + "\n")
        if len(pool) >= needed:
            return pool
    return pool


def fit_prompt(ids: list[int], out_len: int, max_model_len: int) -> tuple[list[int], int]:
    out_len = min(out_len, max_model_len - 1)
    return ids[: max(1, max_model_len - out_len)], out_len


def _longprompt(spec, tokenizer, n, max_model_len, rng) -> list[tuple[list[int], int]]:
    wanted = [
        (
            max(1, round(spec.long_prompt_mean * rng.uniform(0.5, 1.5))),
            max(1, round(spec.long_output_mean * rng.uniform(0.5, 1.5))),
        )
        for _ in range(n)
    ]
    pool = token_pool(tokenizer, sum(p for p, _ in wanted), rng, spec.dataset_limit)
    out, at = [], 0
    for prompt_len, out_len in wanted:
        ids, at = pool[at : at + prompt_len], at + prompt_len
        out.append(fit_prompt(*_scaled(spec, ids, out_len), max_model_len))
    return out


def _trace(spec, tokenizer, n, rate, max_model_len) -> list[Request]:
    """The trace's first n requests (repeated after its end when n is larger), their
    arrival times rescaled so that the mean rate is ``rate``; ``prompt_len`` entries
    filled with the run's sample of ShareGPT text (``sample_seed``)."""
    entries = datasets.read_trace(spec.trace)
    first, last = entries[0].arrival_s, entries[-1].arrival_s
    gap = (last - first) / (len(entries) - 1) if len(entries) > 1 else 0.0
    gap = gap or 1.0  # a one-request trace or one instant: a period of 1 s
    period = last - first + gap
    factor = 0.0 if math.isinf(rate) else 1.0 / (rate * gap)
    by_length = sum(e.prompt_len or 0 for e in entries[: min(n, len(entries))])
    rng = random.Random(sample_seed(spec.seed, rate))
    pool = token_pool(tokenizer, by_length, rng, spec.dataset_limit) if by_length else []
    out, at = [], 0
    for i in range(n):
        e = entries[i % len(entries)]
        t = (e.arrival_s - first + (i // len(entries)) * period) * factor
        if e.prompt is not None:
            ids = tokenizer.encode(e.prompt)
        else:
            ids = [pool[(at + k) % len(pool)] for k in range(max(1, e.prompt_len))]
            at += e.prompt_len
        out.append(Request(t, *fit_prompt(*_scaled(spec, ids, e.output_len), max_model_len)))
    return out
