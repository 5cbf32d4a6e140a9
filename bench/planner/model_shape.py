"""The shape of a decoder-only transformer: what the cost model needs to count FLOPs
and bytes. From a HF ``config.json`` dict, ``engine.config.ModelConfig`` or a preset."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

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

    @property
    def layer_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
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
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def tp_degrees(self, limit: int = 8) -> list[int]:
        """Tensor-parallel degrees that split the heads, KV heads and MLP evenly."""
        sizes = (self.num_heads, self.num_kv_heads, self.intermediate_size)
        return [t for t in range(1, limit + 1) if all(s % t == 0 for s in sizes)]

    def with_dtype(self, dtype: str) -> ModelShape:
        return replace(self, dtype_bytes=DTYPE_BYTES[dtype])

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "model", dtype: str = "bfloat16") -> ModelShape:
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
        from engine.config import ModelConfig

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


PRESETS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
    "opt-13b": _opt("opt-13b", 40, 5120, 40),
    "opt-66b": _opt("opt-66b", 64, 9216, 72),
    "opt-175b": _opt("opt-175b", 96, 12288, 96),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 8192, 4),
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
