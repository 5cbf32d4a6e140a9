"""Element-wise and normalization ops of the decoder, swappable per backend.

The attention backend chooses the op set: the torch backend uses ``TorchOps``,
the Triton backend its fused kernels. Both compute the same functions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


class Ops(ABC):
    """Contract (shapes are for T tokens):

    * ``rms_norm(x [T, H], w [H], eps)`` -> [T, H]: x / rms(x) * w, computed in float32.
    * ``add_rms_norm(x, residual, w, eps)`` -> (normed, new_residual) with
      new_residual = x + residual and normed = rms_norm(new_residual).
    * ``rotary(q [T, Hq, D], k [T, Hkv, D], positions [T] int64, cos, sin)`` ->
      (q', k') with cos, sin [max_pos, D/2] float32; rotate-half (GPT-NeoX/HF Llama)
      layout: out[:D/2] = x1*c - x2*s, out[D/2:] = x2*c + x1*s.
    * ``silu_and_mul(x [T, 2I])`` -> [T, I] = silu(x[:, :I]) * x[:, I:].
    """

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


class TorchOps(Ops):
    def rms_norm(self, x, w, eps):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * w.float()).to(x.dtype) if x.dtype != torch.float32 else out * w

    def add_rms_norm(self, x, residual, w, eps):
        residual = x + residual
        return self.rms_norm(residual, w, eps), residual

    def rotary(self, q, k, positions, cos, sin):
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        return _rotate(q, c, s), _rotate(k, c, s)

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)
