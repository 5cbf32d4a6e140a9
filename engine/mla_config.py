"""The shape of Multi-head Latent Attention (DeepSeek-V2/V3), read from a HF config.

MLA caches, per token, one compressed latent of ``kv_lora_rank`` floats (after its RMS
norm) and one decoupled RoPE key of ``qk_rope_head_dim`` floats shared by every query
head; ``kv_b_proj`` up-projects the latent into each head's K (its non-rotary part) and
V. Only dense checkpoints load: a mixture-of-experts layer is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# the HF architectures whose attention is MLA (config.json "architectures")
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")


@dataclass(frozen=True)
class MLAConfig:
    """Widths of one MLA layer (every layer has the same).

    q_lora_rank       rank of the low-rank query (q_a_proj -> norm -> q_b_proj); None: q_proj
    kv_lora_rank      Dc, the cached latent's width
    qk_nope_head_dim  per-head width of the query/key part without RoPE
    qk_rope_head_dim  Dr, the RoPE part of each query head and of the one shared key
    v_head_dim        per-head width of V
    rope_interleave   the checkpoint's RoPE rotates adjacent pairs (x0, x1), (x2, x3)...
                      instead of the halves; the loader permutes those rows into halves
    softmax_scale     (qk_nope + qk_rope)^-0.5, times yarn's mscale(factor, mscale_all_dim)^2
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def latent_width(self) -> int:
        """Elements of one token's cache row: the latent, then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, cfg: dict, rope: dict | None) -> MLAConfig:
        """From a DeepSeek-V2/V3 ``config.json`` dict; ``rope`` is its RoPE parameters
        (``rope_parameters`` or ``rope_scaling``). Raises for MoE layers."""
        refuse_moe(cfg)
        nope, rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        v2 = cfg["architectures"][0] == "DeepseekV2ForCausalLM"
        return cls(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=cfg["v_head_dim"],
            # DeepSeek-V2 always rotates pairs (HF applies it as complex numbers)
            rope_interleave=True if v2 else bool(cfg.get("rope_interleave", True)),
            softmax_scale=(nope + rope_dim) ** -0.5 * _mscale_squared(rope),
        )


def refuse_moe(cfg: dict) -> None:
    """Raise when any layer is a mixture of experts: layer i is one when
    ``n_routed_experts`` is set and i >= ``first_k_dense_replace`` (as HF builds them)."""
    experts = cfg.get("n_routed_experts")
    layers = cfg["num_hidden_layers"]
    dense = cfg.get("first_k_dense_replace") or 0
    if experts and dense < layers:
        raise ValueError(
            f"first_k_dense_replace={dense} with n_routed_experts={experts} and "
            f"num_hidden_layers={layers}: layers {dense}..{layers - 1} are mixtures of experts; "
            f"supported are dense layers only (first_k_dense_replace >= num_hidden_layers "
            "or n_routed_experts null)"
        )


def _mscale_squared(rope: dict | None) -> float:
    """yarn's softmax correction as HF's DeepSeek attention applies it."""
    if not rope or rope.get("rope_type", rope.get("type", "default")) == "default":
        return 1.0
    factor, all_dim = rope.get("factor"), rope.get("mscale_all_dim") or 0
    if not all_dim or factor is None or factor <= 1:
        return 1.0
    m = 0.1 * all_dim * math.log(factor) + 1.0
    return m * m
