"""Simulator inputs from ``bench.workloads``: the requests' lengths (the real datasets,
tokenized with a real tokenizer) and their arrival times at a rate."""

from __future__ import annotations

from functools import lru_cache

from bench.workloads import WorkloadSpec, arrival_times, sample_requests

TOKENIZER_MODEL = "smollm2-135m"  # the embedded model; its tokenizer sizes the requests


@lru_cache(maxsize=8)
def _tokenizer(model: str):
    from bench.workloads import model_info

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
