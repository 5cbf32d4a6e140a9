"""The ``sharedprefix`` workload: ``system_prompts`` distinct long system prompts, each
shared by many requests that add a short distinct user question; open-loop.

    reqs = shared_prefix_requests(spec, tokenizer, n=100, rate=2.0, max_model_len=8192)

A system prompt is ``system_prompt_tokens`` tokens on average (uniform 0.5x to 1.5x)
of ShareGPT text (conversations' turns in a seeded order, cut at a token boundary and
decoded); a question is a ShareGPT first human turn of at most ``QUESTION_MAX_TOKENS``
tokens (and 8 characters per such token), its output length the answer's tokens
(scaled, capped). Each request draws its system prompt uniformly; its prompt is the
chat template's rendering of [system, user] with the generation prompt, so every
request of one system prompt shares the rendered system turn token for token (the
template's markers are special tokens: tokenization does not run across them).
Requests that do not fit the context are dropped.

As ``multiturn``, the sample is seeded by the seed and the rate
(``loadgen.workloads.sample_seed``): a later rate must not find an earlier one's system
prompts in the prefix cache.
"""

from __future__ import annotations

import random

from pdserve.loadgen import datasets
from pdserve.loadgen.workloads import (
    MIN_TOKENS,
    Request,
    arrival_times,
    sample_seed,
    shuffled_cycle,
)

QUESTION_MAX_TOKENS = 64


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def system_prompts(spec, tokenizer, rng: random.Random) -> list[str]:
    """``spec.system_prompts`` texts of about ``spec.system_prompt_tokens`` tokens."""
    wanted = [
        max(1, round(spec.system_prompt_tokens * rng.uniform(0.5, 1.5)))
        for _ in range(spec.system_prompts)
    ]
    pool: list[int] = []
    conversations = list(datasets.sharegpt_conversations(spec.dataset_limit))
    for exchanges in shuffled_cycle(conversations, rng, sum(wanted)):
        for prompt, answer in exchanges:
            pool += _text_ids(tokenizer, prompt + "\n" + answer + "\n")
        if len(pool) >= sum(wanted):
            break
    out, at = [], 0
    for n in wanted:
        out.append(tokenizer.decode(pool[at : at + n]))
        at += n
    return out


def questions(spec, tokenizer, rng: random.Random, n: int) -> list[tuple[str, int]]:
    """n (question, output length) pairs: short first human turns (in a seeded order)
    and their answers' lengths."""
    pairs = list(datasets.sharegpt_pairs(spec.dataset_limit))
    out = []
    for prompt, answer in shuffled_cycle(pairs, rng, n):
        if len(prompt) > QUESTION_MAX_TOKENS * 8:  # part of the rule: not encoded
            continue
        q, a = len(_text_ids(tokenizer, prompt)), len(_text_ids(tokenizer, answer))
        if not (MIN_TOKENS <= q <= QUESTION_MAX_TOKENS and a >= MIN_TOKENS):
            continue
        out_len = max(1, round(a * spec.output_scale))
        if spec.max_output_tokens:
            out_len = min(out_len, spec.max_output_tokens)
        out.append((prompt, out_len))
        if len(out) == n:
            break
    return out


def shared_prefix_requests(
    spec, tokenizer, n: int, rate: float, max_model_len: int
) -> list[Request]:
    """n requests arriving at ``rate`` per second (on average)."""
    rng = random.Random(sample_seed(spec.seed, rate))
    systems = system_prompts(spec, tokenizer, rng)
    times = arrival_times(n, rate, spec.burstiness, spec.seed)
    out: list[Request] = []
    for question, out_len in questions(spec, tokenizer, rng, n * 2):
        system = rng.choice(systems)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        if spec.max_prompt_tokens and len(ids) > spec.max_prompt_tokens:
            continue
        if len(ids) + out_len <= max_model_len:
            out.append(Request(times[len(out)], ids, out_len))
            if len(out) == n:
                return out
    raise ValueError(
        f"workload sharedprefix: fewer than {n} requests fit a context of {max_model_len}"
    )
