"""Simulator inputs from ``loadgen.workloads``: the requests' lengths (the real datasets,
tokenized with a real tokenizer) and their arrival times at a rate; or the requests
with their tokens (``sim_inputs``), for prefix hits."""

from __future__ import annotations

from functools import lru_cache

from pdserve.loadgen.workloads import WorkloadSpec, arrival_times, make_workload, sample_requests
from pdserve.planner.prefix import SimInput

TOKENIZER_MODEL = "smollm2-135m"  # the embedded model; its tokenizer sizes the requests


@lru_cache(maxsize=8)
def _tokenizer(model: str):
    from pdserve.loadgen.workloads import model_info

    return model_info(model)[0]


def sample_lengths(
    spec: WorkloadSpec, n: int, max_len: int, tokenizer_model: str = TOKENIZER_MODEL
) -> list[tuple[int, int]]:
    """n (prompt length, output length) pairs that fit a context of ``max_len``."""
    pairs = sample_requests(spec, _tokenizer(tokenizer_model), n, max_len)
    return [(len(ids), out) for ids, out in pairs]


def with_arrivals(
    lengths: list[tuple[int, int]], rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[tuple[float, int, int]]:
    """The (arrival_s, prompt, output) triples the simulator takes, at ``rate`` per second."""
    times = arrival_times(len(lengths), rate, burstiness, seed)
    return [(t, p, o) for t, (p, o) in zip(times, lengths, strict=True)]


def sim_inputs(
    spec: WorkloadSpec, n: int, rate: float, max_len: int, tokenizer_model: str = TOKENIZER_MODEL
) -> list[SimInput]:
    """The workload's requests with their token ids, as ``pdserve bench`` sends them at
    ``rate``. ``multiturn``: n conversations, closed-loop, each turn following the one
    before by its think time, the dataset's answers standing for the server's (same
    lengths); other workloads: open-loop, outputs of token 0 (their content is never
    asked for by another prompt)."""
    tokenizer = _tokenizer(tokenizer_model)
    if spec.name != "multiturn":
        reqs = make_workload(spec, tokenizer, n, rate, max_len)
        return [SimInput(r.arrival_s, r.prompt_token_ids, [0] * r.output_len) for r in reqs]
    from pdserve.loadgen.multiturn import make_conversations, turn_prompts

    out: list[SimInput] = []
    for conv in make_conversations(spec, tokenizer, n, rate, max_len):
        answers = [t.planned_answer for t in conv.turns]
        for k, (turn, prompt) in enumerate(
            zip(conv.turns, turn_prompts(conv, answers), strict=True)
        ):
            follows = len(out) - 1 if k else None
            out.append(SimInput(conv.arrival_s, prompt, answers[k], follows, turn.think_s))
    return out
