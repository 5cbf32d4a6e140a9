"""Dense projections ``x @ W.T`` with W in its checkpoint layout [out, in].

On CPU in float32, a decode-sized batch (up to ``cpu_gemm.MAX_ROWS`` rows) goes through
the C kernel of ``engine/cpu_gemm.py``, which streams each weight row once at close to
the memory bandwidth; larger batches (prefill) through MKL, which is compute-bound
there: with the weight's packed twin (``engine/mkl_packed.py``) when the model made
one, else ``F.linear``. ``prepare`` makes each weight contiguous once after loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cpu_gemm import CpuGemm, cpu_gemm
from engine.mkl_packed import PackedWeight


def prepare(weight: torch.Tensor) -> torch.Tensor:
    """The stored form of an [out, in] weight: contiguous."""
    return weight.contiguous()


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None = None
) -> torch.Tensor:
    """x [T, in] @ W.T; ``packed``, when given, holds the same W packed for MKL."""
    if CpuGemm.supports(x, weight):
        kernel = cpu_gemm()
        if kernel is not None:
            return kernel(x, weight)
    if packed is not None and packed.supports(x):
        return packed(x)
    return F.linear(x, weight)
