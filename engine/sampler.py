"""Next-token choice per request: greedy, or temperature / top-k / top-p sampling.

A request with a seed draws from its own generator, so its tokens do not depend
on what else is in the batch; the others share the engine's generator.
"""

from __future__ import annotations

import torch

from engine.cpu_ops import CpuOps, cpu_ops
from engine.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits [S, V] float32, one row per request -> one token id per request."""
        native = cpu_ops() if CpuOps.supports(logits) and logits.dim() == 2 else None
        greedy = (logits.argmax(dim=-1) if native is None else native.argmax(logits)).tolist()
        out = []
        for i, request in enumerate(requests):
            p = request.params
            if p.greedy:
                out.append(greedy[i])
                continue
            probs = _filtered_probs(logits[i], p.temperature, p.top_k, p.top_p)
            gen = request.generator or self.generator
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
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs / sorted_probs.sum())
    return probs
