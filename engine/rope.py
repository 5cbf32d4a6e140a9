"""Rotary position tables, with the Llama-3 or yarn frequency scaling when the config asks."""

from __future__ import annotations

import math

import torch

from pdserve.engine.families import ROPE_TYPES


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
    if kind == "yarn":
        return _yarn_frequencies(inv, head_dim, theta, scaling)
    raise ValueError(f"rope_scaling.rope_type={kind!r}: supported are {', '.join(ROPE_TYPES)}")


def _yarn_frequencies(inv: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original
    context are interpolated (divided by ``factor``), those that turn more than
    ``beta_fast`` times kept, a linear ramp between (HF's ``_compute_yarn_parameters``)."""
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def attention_factor(scaling: dict | None) -> float:
    """What yarn multiplies cos and sin by (1 for the other kinds)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale(1)


def rope_tables(
    head_dim: int, max_position: int, theta: float, scaling: dict | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_position, head_dim / 2] float32 (yarn: times its
    ``attention_factor``)."""
    inv = inv_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
    factor = attention_factor(scaling)
    return angles.cos() * factor, angles.sin() * factor
