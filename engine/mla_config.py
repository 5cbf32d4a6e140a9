"""The shape of latent and tied attention, read from a HF-style config: MLA (DeepSeek-V2/V3),
and GLA and GTA ("Hardware-Efficient Attention for Fast Decoding", arXiv 2505.21487).

All three cache per token ``latent_heads`` states of ``kv_lora_rank`` floats and one
decoupled RoPE key of ``qk_rope_head_dim`` floats shared by every query head; query head
h reads state h // (num_heads / latent_heads).
  MLA  one latent (after its RMS norm); ``kv_b_proj`` up-projects it into each head's
       K (its non-rotary part) and V. Only dense DeepSeek checkpoints load: a
       mixture-of-experts layer is refused by name.
  GLA  MLA with ``num_latent_heads`` latents (each RMS-normed on its own), each
       up-projected only for its group of query heads; architecture ``GLAForCausalLM``
       (DeepSeek-V3's keys and tensor names, plus ``num_latent_heads``).
  GTA  one tied state of ``head_dim`` per group of query heads, no up-projection: V is
       the state, the key its first head_dim / 2 floats then the RoPE key (head_dim / 2,
       from one single-head projection); architecture ``GTAForCausalLM`` (Llama's keys:
       ``num_key_value_heads`` tied states of ``head_dim``; tensors ``q_proj``,
       ``kv_proj``, ``k_rope_proj``, ``o_proj``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# config.json "architectures" whose attention is latent or tied
MLA_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM",
    "GLAForCausalLM",
    "GTAForCausalLM",
)


@dataclass(frozen=True)
class MLAConfig:
    """Widths of one latent/tied attention layer (every layer has the same).

    q_lora_rank       rank of the low-rank query (q_a_proj -> norm -> q_b_proj); None: q_proj
    kv_lora_rank      Dc, the width of one cached latent/tied state
    qk_nope_head_dim  per-head width of the query/key part without RoPE (Dk = Dc / 2 for GTA)
    qk_rope_head_dim  Dr, the RoPE part of each query head and of the one shared key
    v_head_dim        per-head width of V (Dc for GTA)
    rope_interleave   the checkpoint's RoPE rotates adjacent pairs (x0, x1), (x2, x3)...
                      instead of the halves; the loader permutes those rows into halves
    softmax_scale     (qk_nope + qk_rope)^-0.5, times yarn's mscale(factor, mscale_all_dim)^2
    latent_heads      Hc: latents (MLA 1, GLA h_c) or tied states (GTA: groups)
    tied              GTA: K and V are the cached state itself (no kv_b, no latent norm)
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float
    latent_heads: int = 1
    tied: bool = False

    @property
    def replicated(self) -> bool:
        """One latent for all heads (MLA): every tensor-parallel rank holds all of it."""
        return self.latent_heads == 1

    @classmethod
    def from_hf(cls, cfg: dict, rope: dict | None) -> MLAConfig:
        """From a ``config.json`` dict of one of ``MLA_ARCHITECTURES``; ``rope`` is its
        RoPE parameters (``rope_parameters`` or ``rope_scaling``). Raises for MoE layers."""
        arch = cfg["architectures"][0]
        if arch == "GTAForCausalLM":
            d = cfg["head_dim"]
            return cls(
                None,
                d,
                d // 2,
                d // 2,
                d,
                False,
                d**-0.5 * _mscale_squared(rope),
                latent_heads=cfg["num_key_value_heads"],
                tied=True,
            )
        refuse_moe(cfg)
        nope, rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        # DeepSeek-V2 always rotates pairs (HF applies it as complex numbers)
        interleave = arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True))
        return cls(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=cfg["v_head_dim"],
            rope_interleave=interleave,
            softmax_scale=(nope + rope_dim) ** -0.5 * _mscale_squared(rope),
            latent_heads=cfg.get("num_latent_heads", 1) if arch == "GLAForCausalLM" else 1,
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
