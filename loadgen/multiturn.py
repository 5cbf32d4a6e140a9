"""The ``multiturn`` workload: ShareGPT conversations replayed turn by turn, each turn's
prompt the chat-template rendering of the history (earlier user turns and the answers
the server gave) plus the next user message.

    convs = make_conversations(spec, tokenizer, n=10, rate=0.5, max_model_len=8192)
    prompts = turn_prompts(convs[0], [t.planned_answer for t in convs[0].turns])

A conversation is closed-loop: its turn k + 1 is sent ``think_s`` after the answer to
turn k ended (``loadgen.chat_replay`` drives it), conversations arrive at the rate
(Gamma gaps, as every workload). A turn is stored as the token ids it ADDS after the
previous answer (``Turn.ids``), so that whatever the server answers, prompt k + 1 =
prompt k + answer k (its token ids, as generated) + turn k + 1's ids, token for token:

    turn 0 ids:   render([user 0], generation prompt)                        tokenized
    turn k ids:   render(history + [assistant X, user k], generation prompt)
                  minus render(history, generation prompt) + X                tokenized

with the chat template's text around an answer (its end marker, the next user turn,
the generation prompt) tokenized alone: a template whose rendering of a longer history
does not extend the shorter one's is refused. Lengths are therefore known before the
run (the ids a turn adds do not depend on the answer), which is how a conversation is
cut to fit: it ends before the first turn whose prompt + output exceeds the context or
``max_prompt_tokens``.

Output lengths are the dataset answers' token counts (scaled, capped). Think times are
exponential of mean ``think_time_s``, seeded per conversation. The sample is seeded by
the seed AND the rate (``sample_seed``): a later rate must not find an earlier one's
conversations in the prefix cache; contenders of ``pdserve compare`` measured at the
same rate get the same conversations.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.loadgen import datasets
from pdserve.loadgen.workloads import Request, arrival_times, sample_seed, shuffled_cycle

_ANSWER = "\x00ANSWER\x00"  # stands for an answer while the template is rendered


@dataclass(frozen=True)
class Turn:
    ids: list[int]  # tokens this turn adds after the previous answer (turn 0: its prompt)
    output_len: int  # tokens asked for its answer (ignore_eos: exactly these)
    think_s: float  # pause after the previous answer ends (0 for the first turn)
    planned_answer: list[int]  # the dataset answer's ids, output_len of them (offline use)


@dataclass(frozen=True)
class Conversation:
    index: int
    arrival_s: float  # when its first turn is sent, seconds after the start of the run
    turns: list[Turn]


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def continuation_text(tokenizer, history: list[dict], user: str) -> str:
    """The template's text between an answer to ``history``'s last user turn and the
    answer to ``user``: the answer's end, the user turn, the generation prompt."""
    head = tokenizer.apply_chat_template(history, add_generation_prompt=True)
    more = [*history, {"role": "assistant", "content": _ANSWER}, {"role": "user", "content": user}]
    full = tokenizer.apply_chat_template(more, add_generation_prompt=True)
    if not full.startswith(head + _ANSWER):
        raise ValueError(
            "workload multiturn: the model's chat template does not render a longer history "
            "as an extension of the shorter one (needed to append turns token for token)"
        )
    return full[len(head) + len(_ANSWER) :]


def _answer_ids(tokenizer, answer: str, n: int) -> list[int]:
    ids = _text_ids(tokenizer, answer) or [0]
    return (ids * (n // len(ids) + 1))[:n]


def build_conversation(
    spec, tokenizer, index: int, exchanges: list[tuple[str, str]], max_model_len: int
) -> Conversation | None:
    """One conversation of at most ``spec.max_turns`` turns that fit the context and
    ``spec.max_prompt_tokens``; None when not even its first turn fits."""
    rng = random.Random(f"{spec.seed}-think-{index}")
    history: list[dict] = []
    turns: list[Turn] = []
    prompt_len = 0
    for k, (user, answer) in enumerate(exchanges[: spec.max_turns]):
        if k == 0:
            ids = tokenizer.encode(
                tokenizer.apply_chat_template([{"role": "user", "content": user}])
            )
        else:
            ids = _text_ids(tokenizer, continuation_text(tokenizer, history, user))
        out = max(1, round(len(_text_ids(tokenizer, answer)) * spec.output_scale))
        if spec.max_output_tokens:
            out = min(out, spec.max_output_tokens)
        prompt_len += (turns[-1].output_len if turns else 0) + len(ids)
        too_long = spec.max_prompt_tokens and prompt_len > spec.max_prompt_tokens
        if too_long or prompt_len + out > max_model_len:
            break
        think = rng.expovariate(1.0 / spec.think_time_s) if k and spec.think_time_s else 0.0
        turns.append(Turn(ids, out, think, _answer_ids(tokenizer, answer, out)))
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return Conversation(index, 0.0, turns) if turns else None


def make_conversations(
    spec, tokenizer, n: int, rate: float, max_model_len: int
) -> list[Conversation]:
    """n conversations of at least two exchanges in the dataset, arriving at ``rate``
    per second (on average); the sample depends on the seed and the rate."""
    pool = [c for c in datasets.sharegpt_conversations(spec.dataset_limit) if len(c) >= 2]
    if not pool:
        raise ValueError("workload multiturn: no ShareGPT conversation has two exchanges")
    times = arrival_times(n, rate, spec.burstiness, spec.seed)
    out: list[Conversation] = []
    for exchanges in shuffled_cycle(pool, random.Random(sample_seed(spec.seed, rate)), n):
        if len(out) == n:
            return out
        conv = build_conversation(spec, tokenizer, len(out), exchanges, max_model_len)
        if conv is not None:
            out.append(Conversation(conv.index, times[len(out)], conv.turns))
    if len(out) < n:
        raise ValueError(f"workload multiturn: fewer than {n} conversations fit the context")
    return out


def turn_prompts(conv: Conversation, answers: list[list[int]]) -> list[list[int]]:
    """Each turn's prompt ids given the answers' ids (``answers[k]`` answers turn k; the
    last one is not needed)."""
    prompts, prompt = [], []
    for k, turn in enumerate(conv.turns):
        prompt = prompt + (answers[k - 1] if k else []) + turn.ids
        prompts.append(prompt)
    return prompts


def first_turns(conversations: list[Conversation]) -> list[Request]:
    """The conversations' first turns as requests sent at once (the warm-up)."""
    return [Request(0.0, c.turns[0].ids, c.turns[0].output_len) for c in conversations]
