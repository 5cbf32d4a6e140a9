"""Rotary position tables, with the Llama-3 frequency scaling when the config asks for it."""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(mid, smoothed, out)
    raise ValueError(f"rope_scaling.rope_type={kind!r}: supported are default, linear, llama3")


def rope_tables(
    head_dim: int, max_position: int, theta: float, scaling: dict | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_position, head_dim / 2] float32."""
    inv = inv_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()
