"""Dense projections ``x @ W.T`` with W in its checkpoint layout [out, in].

On CPU in float32 a weight has a twin, packed on first use: its panels for the C kernel
of ``engine/cpu_gemm.py``, which serves every batch (decode steps and prefill chunks)
with one arithmetic, from the GGUF's Q4 / Q8 blocks where the weight holds them, and on
AMX tiles for large batches where the CPU has them. Without a twin (no C compiler,
another dtype or device), ``F.linear`` runs. ``prepare`` makes each weight contiguous
once after loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.cpu_gemm import PanelWeight


def prepare(weight: torch.Tensor) -> torch.Tensor:
    """The stored form of an [out, in] weight: contiguous."""
    return weight.contiguous()


def linear(
    x: torch.Tensor, weight: torch.Tensor, panels: PanelWeight | None = None
) -> torch.Tensor:
    """x [T, in] @ W.T; ``panels``, when given, holds the same W packed for the C kernel."""
    if panels is not None and panels.supports(x):
        return panels(x)
    return F.linear(x, weight)
