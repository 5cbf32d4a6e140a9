"""Dense projections ``x @ W.T`` with W in its checkpoint layout [out, in].

On CPU in float32 a weight may have two twins, each packed on first use: its panels for
the C kernel of ``engine/cpu_gemm.py``, which takes decode-sized batches (up to
``cpu_gemm.MAX_ROWS`` rows) and streams each weight once per step, and, where the CPU
has AMX and the panels hold a GGUF's blocks, larger batches too (``engine/amx_gemm.py``);
and its MKL-packed form (``engine/mkl_packed.py``) for the other larger batches
(prefill), where the product is compute-bound. Without a twin that fits, ``F.linear``
runs. ``prepare`` makes each weight contiguous once after loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cpu_gemm import PanelWeight
from engine.mkl_packed import PackedWeight


def prepare(weight: torch.Tensor) -> torch.Tensor:
    """The stored form of an [out, in] weight: contiguous."""
    return weight.contiguous()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: PackedWeight | None = None,
    panels: PanelWeight | None = None,
) -> torch.Tensor:
    """x [T, in] @ W.T; ``packed`` and ``panels``, when given, hold the same W packed for
    MKL and for the small-batch C kernel."""
    if panels is not None and panels.supports(x):
        return panels(x)
    if packed is not None and packed.supports(x):
        return packed(x)
    return F.linear(x, weight)
