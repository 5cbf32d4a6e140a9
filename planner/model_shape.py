"""The shape of a decoder-only transformer: what the cost model needs to count FLOPs
and bytes. From a HF ``config.json`` dict, ``engine.config.ModelConfig`` or a preset.

The attention is per-head K/V (MHA, GQA: ``num_kv_heads`` x ``head_dim``) or, with
``latent`` set, a latent or tied cache row (MLA, GLA, GTA; ``planner.attention``),
whose KV bytes per device depend on the tensor-parallel degree."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.planner.attention import AttentionShape, GroupedAttention, LatentAttention

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int = 2048
    dtype_bytes: int = 2
    mlp_matrices: int = 3  # gated (SwiGLU): gate, up, down; OPT's MLP has two
    latent: LatentAttention | None = None  # set: num_kv_heads and head_dim are not the KV

    @property
    def attention(self) -> AttentionShape:
        return self.latent or GroupedAttention(self.num_kv_heads, self.head_dim)

    @property
    def layer_params(self) -> int:
        attn = self.attention.params(self.hidden_size, self.num_heads)
        return attn + self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def params(self) -> int:
        """Weights read per forward pass: the layers and the LM head (the embedding table
        is gathered, not read whole)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return (self.params + self.vocab_size * self.hidden_size) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """One copy of a token's KV, all layers (a single device's cache)."""
        return round(self.kv_bytes_per_device(1))

    def kv_bytes_per_device(self, tp: int) -> float:
        """KV bytes per token one rank of a ``tp``-degree instance holds, all layers."""
        return self.num_layers * self.attention.row_elements(tp) * self.dtype_bytes

    def kv_bytes_per_instance(self, tp: int) -> float:
        """KV bytes per token an instance of ``tp`` ranks holds in all: ``tp`` times a
        rank's (MLA's replicated latent counts once per rank)."""
        return tp * self.kv_bytes_per_device(tp)

    def kv_transfer_bytes(self, tokens: int, decode_tp: int) -> int:
        """Bytes a handoff of ``tokens`` tokens moves to a decode instance of ``decode_tp``
        ranks (``AttentionShape.transfer_elements``: each decode rank receives its row,
        MLA's replicated latent travels once per instance)."""
        elements = self.attention.transfer_elements(decode_tp)
        return round(tokens * self.num_layers * elements * self.dtype_bytes)

    def tp_degrees(self, limit: int = 8) -> list[int]:
        """Tensor-parallel degrees that split the heads, the KV (or latent) heads and the
        MLP evenly (MLA's single latent: replicated on every rank)."""
        sizes = (self.num_heads, self.intermediate_size)
        return [
            t
            for t in range(1, limit + 1)
            if all(s % t == 0 for s in sizes) and self.attention.supports(t)
        ]

    def with_dtype(self, dtype: str) -> ModelShape:
        return replace(self, dtype_bytes=DTYPE_BYTES[dtype])

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "model", dtype: str = "bfloat16") -> ModelShape:
        if cfg.get("model_type") in ("deepseek_v2", "deepseek_v3"):
            return _deepseek_from_hf(cfg, name, DTYPE_BYTES[dtype])
        if cfg.get("model_type") == "opt":
            heads = cfg["num_attention_heads"]
            return cls(
                name,
                cfg["num_hidden_layers"],
                cfg["hidden_size"],
                heads,
                heads,
                cfg["hidden_size"] // heads,
                cfg["ffn_dim"],
                cfg["vocab_size"],
                cfg.get("max_position_embeddings", 2048),
                DTYPE_BYTES[dtype],
                mlp_matrices=2,
            )
        from pdserve.engine.config import ModelConfig

        return cls.from_model_config(ModelConfig.from_hf(cfg), name, dtype)

    @classmethod
    def from_model_config(cls, mc, name: str = "model", dtype: str = "bfloat16") -> ModelShape:
        return cls(
            name,
            mc.num_layers,
            mc.hidden_size,
            mc.num_heads,
            mc.num_kv_heads,
            mc.head_dim,
            mc.intermediate_size,
            mc.vocab_size,
            mc.max_position,
            DTYPE_BYTES[dtype],
            latent=None if mc.mla is None else _engine_latent(mc.mla),
        )


def _engine_latent(m) -> LatentAttention:
    """The planner's view of the engine's ``MLAConfig`` (engine/mla_config.py)."""
    return LatentAttention(
        heads=m.latent_heads,
        dim=m.kv_lora_rank,
        rope_dim=m.qk_rope_head_dim,
        key_dim=m.qk_nope_head_dim if m.tied else m.kv_lora_rank,
        qk_nope_dim=m.qk_nope_head_dim,
        v_head_dim=m.v_head_dim,
        q_lora_rank=m.q_lora_rank or 0,
        up_projected=not m.tied,
    )


def _opt(name, layers, hidden, heads):
    return ModelShape(
        name,
        layers,
        hidden,
        heads,
        heads,
        hidden // heads,
        4 * hidden,
        50272,
        2048,
        2,
        mlp_matrices=2,
    )


def _deepseek_from_hf(cfg: dict, name: str, dtype_bytes: int) -> ModelShape:
    """A DeepSeek-V2/V3 config's MLA shape; dense layers only (MoE is not modelled)."""
    layers, experts = cfg["num_hidden_layers"], cfg.get("n_routed_experts")
    dense = cfg.get("first_k_dense_replace", 0)
    if experts and dense < layers:
        raise ValueError(
            f"model {name!r}: n_routed_experts={experts} with first_k_dense_replace={dense} < "
            f"num_hidden_layers={layers} makes MoE layers, which the planner does not model; "
            "allowed: dense layers only (first_k_dense_replace >= num_hidden_layers)"
        )
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_rank = cfg["kv_lora_rank"]
    latent = LatentAttention(1, kv_rank, rope, kv_rank, nope, v, cfg.get("q_lora_rank") or 0)
    heads = cfg["num_attention_heads"]
    return ModelShape(
        name,
        layers,
        cfg["hidden_size"],
        heads,
        1,
        nope + rope,
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg.get("max_position_embeddings", 2048),
        dtype_bytes,
        latent=latent,
    )


def _deepseek_v3_dense(name: str, kv_heads: int = 128, latent: LatentAttention | None = None):
    """DeepSeek-V3's attention dims (hidden 7168, 128 heads of 128 + a 64-wide RoPE part,
    q_lora_rank 1536, 61 layers, vocab 129280) with a dense SwiGLU MLP of 18432 in every
    layer: MoE is not modelled, so its params, weights and step times are those of a
    ~36B dense model, not DeepSeek-V3's 671B (37B active). ``latent``: MLA, or its GLA /
    GTA variant as arXiv 2505.21487 defines them (d_h = 128: MLA one 4 d_h latent, GLA
    latent heads of 2 d_h keeping DeepSeek's low-rank query, GTA tied heads of d_h with a
    d_h/2 RoPE key and a plain query projection, as the paper's and the engine's GTA);
    else MHA / GQA of the same width (``kv_heads`` x 128)."""
    head_dim = 192 if latent else 128
    heads = latent.heads if latent else kv_heads
    return ModelShape(name, 61, 7168, 128, heads, head_dim, 18432, 129280, 163840, 2, latent=latent)


def _latent(heads: int, dim: int, tied: bool = False) -> LatentAttention:
    """DeepSeek-V3-shaped latent attention: RoPE 64, heads of 128 (GTA: a 64 key half)."""
    if tied:
        return LatentAttention(heads, dim, 64, dim // 2, 64, 128, up_projected=False)
    return LatentAttention(heads, dim, 64, dim, 128, 128, 1536)


PRESETS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
    "opt-13b": _opt("opt-13b", 40, 5120, 40),
    "opt-66b": _opt("opt-66b", 64, 9216, 72),
    "opt-175b": _opt("opt-175b", 96, 12288, 96),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 8192, 4),
    # one representative size of each family of engine/families.py, the shapes as their
    # published config.json files state them (written from those, not read here); the
    # planner counts every layer's KV in full, so sliding-window layers (Mistral's 4096,
    # Gemma's local layers) are charged more KV than they keep
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, 32768),
    "qwen3-8b": ModelShape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, 40960),
    "mistral-7b": ModelShape("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000, 32768),
    "gemma-2-9b": ModelShape("gemma-2-9b", 42, 3584, 16, 8, 256, 14336, 256000, 8192),
    "gemma-3-12b": ModelShape("gemma-3-12b", 48, 3840, 16, 8, 256, 15360, 262208, 131072),
    "phi-3-mini": ModelShape("phi-3-mini", 32, 3072, 32, 32, 96, 8192, 32064, 4096),
    "deepseek-v3-dense": _deepseek_v3_dense("deepseek-v3-dense", latent=_latent(1, 512)),
    "deepseek-v3-dense-gla-2": _deepseek_v3_dense(
        "deepseek-v3-dense-gla-2", latent=_latent(2, 256)
    ),
    "deepseek-v3-dense-gla-4": _deepseek_v3_dense(
        "deepseek-v3-dense-gla-4", latent=_latent(4, 256)
    ),
    "deepseek-v3-dense-gta-8": _deepseek_v3_dense(
        "deepseek-v3-dense-gta-8", latent=_latent(8, 128, tied=True)
    ),
    "deepseek-v3-dense-gqa-8": _deepseek_v3_dense("deepseek-v3-dense-gqa-8", kv_heads=8),
    "deepseek-v3-dense-mha": _deepseek_v3_dense("deepseek-v3-dense-mha"),
}


def get_model(name: str, dtype: str | None = None) -> ModelShape:
    """A preset (case-insensitive), a HF folder or a config.json path; ``dtype``
    overrides the weights' bytes (presets are bfloat16, smollm2-135m float32 as served)."""
    key = name.lower()
    if key in PRESETS:
        shape = PRESETS[key]
    else:
        path = Path(name).expanduser()
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(
                f"model {name!r}: not a preset ({', '.join(PRESETS)}) nor a HF config.json"
            )
        shape = ModelShape.from_hf(json.loads(path.read_text()), path.parent.name)
    return shape.with_dtype(dtype) if dtype else shape
