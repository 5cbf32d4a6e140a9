"""Next-token choice per request: greedy, or temperature / top-k / top-p sampling.

A seeded request's draw for output position ``p`` (the number of output tokens before
the one drawn) comes from a generator seeded with ``position_seed(seed, p)`` and from
nothing else: its tokens do not depend on what else is in the batch, on preemptions,
or on which process draws them, so a request resumed elsewhere from its first ``p``
output tokens draws what an uninterrupted run would. Unseeded requests share the
engine's generator.
"""

from __future__ import annotations

import torch

from engine.cpu_ops import CpuOps, cpu_ops
from engine.request import Request

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at output ``position``: the
    ``position + 1``-th output of splitmix64 started from ``seed`` (its 64 bits, two's
    complement for a negative seed). Distinct positions give unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits [S, V] float32, one row per request -> one token id per request, drawn
        at each request's current output position (``num_output_tokens``)."""
        native = cpu_ops() if CpuOps.supports(logits) and logits.dim() == 2 else None
        greedy = (logits.argmax(dim=-1) if native is None else native.argmax(logits)).tolist()
        out = []
        for i, request in enumerate(requests):
            p = request.params
            if p.greedy:
                out.append(greedy[i])
                continue
            probs = _filtered_probs(logits[i], p.temperature, p.top_k, p.top_p)
            gen = self.generator
            if p.seed is not None:
                gen = torch.Generator().manual_seed(
                    position_seed(p.seed, request.num_output_tokens)
                )
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
        return out


def _filtered_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float):
    row = row / temperature
    if 0 < top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p, and always the first token
        # (a top_p below float32's range compares as 0, which would drop every token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
        drop[0] = False
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs / sorted_probs.sum())
    return probs
