"""Copy HF-named checkpoint tensors into a (possibly sharded) LlamaModel.

Each HF tensor maps to a slice of one of our fused parameters; the part of the
source that belongs to this tensor-parallel rank is cut here, so no rank keeps
more than its share after loading.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_PARTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
)


def _layer_slot(model, layer, part: str, w: torch.Tensor):
    """(destination view, source slice) for one decoder-layer tensor, or None if unknown."""
    cfg, tp, d = model.cfg, model.tp, model.cfg.head_dim
    q0, q1 = tp.shard(cfg.num_heads, "num_heads")
    k0, k1 = tp.shard(cfg.num_kv_heads, "num_kv_heads")
    i0, i1 = tp.shard(cfg.intermediate_size, "intermediate_size")
    nq, nk, inter = (q1 - q0) * d, (k1 - k0) * d, i1 - i0
    if part == "input_layernorm.weight":
        return layer.input_norm, w
    if part == "post_attention_layernorm.weight":
        return layer.post_norm, w
    if part == "self_attn.q_proj.weight":
        return layer.qkv[:nq], w[q0 * d : q1 * d]
    if part == "self_attn.k_proj.weight":
        return layer.qkv[nq : nq + nk], w[k0 * d : k1 * d]
    if part == "self_attn.v_proj.weight":
        return layer.qkv[nq + nk :], w[k0 * d : k1 * d]
    if part == "self_attn.o_proj.weight":
        return layer.o, w[:, q0 * d : q1 * d]
    if part == "mlp.gate_proj.weight":
        return layer.gate_up[:inter], w[i0:i1]
    if part == "mlp.up_proj.weight":
        return layer.gate_up[inter:], w[i0:i1]
    if part == "mlp.down_proj.weight":
        return layer.down, w[:, i0:i1]
    return None


def assign_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    cfg = model.cfg
    v0, v1 = model.vocab_range
    pending = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    pending |= {f"model.layers.{i}.{part}" for i in range(cfg.num_layers) for part in _LAYER_PARTS}
    embed = None
    for name, w in weights:
        if name == "model.embed_tokens.weight":
            slot, embed = (model.embed, w), w
        elif name == "model.norm.weight":
            slot = (model.norm, w)
        elif name == "lm_head.weight":
            slot = (model.lm_head, w[v0:v1])
        elif (m := _LAYER.match(name)) and int(m.group(1)) < cfg.num_layers:
            if m.group(2).endswith("rotary_emb.inv_freq"):
                continue
            slot = _layer_slot(model, model.layers[int(m.group(1))], m.group(2), w)
        else:
            slot = None
        if slot is None:
            raise ValueError(f"weight {name}: not a parameter of this {cfg.num_layers}-layer Llama")
        _copy(name, *slot)
        pending.discard(name)
    if "lm_head.weight" in pending and embed is not None and cfg.tie_embeddings:
        _copy("lm_head.weight (tied to the embedding)", model.lm_head, embed[v0:v1])
        pending.discard("lm_head.weight")
    if pending:
        raise ValueError(f"checkpoint is missing weights: {', '.join(sorted(pending))}")


def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
