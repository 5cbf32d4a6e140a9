"""What this machine can do at best: memory bandwidth and matmul peak, measured now."""

from __future__ import annotations

import time

import torch


def best_of(fn, repeats: int = 5) -> float:
    """Shortest wall time of ``repeats`` calls, in seconds (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second moved by a large tensor copy, counting the read and the write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = best_of(lambda: dst.copy_(src), repeats=3)
    return 2 * nbytes / seconds


def matmul_peak(n: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul (the best of ``repeats``)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = best_of(lambda: torch.mm(a, b), repeats=repeats)
    return 2 * n**3 / seconds
