"""Copy HF-named checkpoint tensors into a (possibly sharded) LlamaModel.

Each HF tensor maps to a slice of one of our fused parameters; the part of the
source that belongs to this tensor-parallel rank is cut here, so no rank keeps
more than its share after loading. Latent/tied attention tensors (DeepSeek's MLA, GLA,
GTA) go to the layer's ``MLAAttention`` (engine/mla.py), RoPE rows in rotate-half order.
The family (engine/families.py) adds its tensors: q/k/v biases (sliced with their heads),
per-head q/k norms (replicated), Gemma's four norms a layer, Phi-3's fused qkv_proj and
gate_up_proj (this rank's q, k, v and gate, up rows cut from each); a ``norm_plus_one``
family's norm weights are stored as 1 + w.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_COMMON_PARTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
)
_LLAMA_PARTS = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
_FUSED_PARTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{p}_proj.weight" for p in ("qkv", "o")),
    *(f"mlp.{p}_proj.weight" for p in ("gate_up", "down")),
)
_MLA_PARTS = tuple(
    f"self_attn.{p}.weight" for p in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
)
_GTA_PARTS = tuple(f"self_attn.{p}.weight" for p in ("q_proj", "kv_proj", "k_rope_proj", "o_proj"))


def _layer_parts(cfg) -> tuple[str, ...]:
    """The HF tensor names (after ``model.layers.N.``) every layer must have."""
    if cfg.mla is None:
        family = cfg.family
        parts = _FUSED_PARTS if family.fused_weights else _COMMON_PARTS + _LLAMA_PARTS
        if family.qkv_bias:
            parts += tuple(f"self_attn.{p}_proj.bias" for p in "qkv")
        if family.qk_norm:
            parts += ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
        if family.sandwich_norms:
            parts += ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
        return parts
    if cfg.mla.tied:
        return _COMMON_PARTS + _GTA_PARTS
    q = ("q_proj",) if cfg.mla.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    return _COMMON_PARTS + _MLA_PARTS + tuple(f"self_attn.{p}.weight" for p in q)


def _halves(w: torch.Tensor, rope: int, interleaved: bool) -> torch.Tensor:
    """Rows [..., rope, in] of interleaved RoPE pairs (x0, x1), (x2, x3) ... reordered
    to (x0, x2, ..., x1, x3, ...): rotate-half RoPE on those gives the same scores."""
    if not interleaved:
        return w
    return torch.cat([w[..., 0:rope:2, :], w[..., 1:rope:2, :]], dim=-2)


def _mla_slot(model, layer, part: str, w: torch.Tensor):
    """(destination, source slice) for one latent/tied attention tensor, or None if
    unknown: this rank's query heads and latent heads (MLA's one latent whole)."""
    m, mla = model.cfg.mla, layer.mla
    if part not in _layer_parts(model.cfg):
        return None
    h0, h1 = model.tp.shard(model.cfg.num_heads, "num_heads")
    (g0, g1), dn, dr, dc = mla.latent_range, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    qa, width = mla.q_a_width, mla.cache_width - dr  # this rank's latent floats per token
    heads = lambda w: w.view(model.cfg.num_heads, -1, w.shape[-1])[h0:h1]  # noqa: E731
    if part in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
        q = heads(w)
        q = torch.cat([q[:, :dn], _halves(q[:, dn:], dr, m.rope_interleave)], 1).flatten(0, 1)
        return (mla.fused_a[:qa], q) if part.endswith("q_proj.weight") else (mla.q_b, q)
    if part == "self_attn.q_a_proj.weight":
        return mla.fused_a[:qa], w
    if part == "self_attn.q_a_layernorm.weight":
        return mla.q_a_norm, w
    if part == "self_attn.kv_a_proj_with_mqa.weight":
        rope = _halves(w[m.latent_heads * dc :], dr, m.rope_interleave)
        return mla.fused_a[qa:], torch.cat([w[g0 * dc : g1 * dc], rope])
    if part == "self_attn.kv_proj.weight":
        return mla.fused_a[qa : qa + width], w[g0 * dc : g1 * dc]
    if part == "self_attn.k_rope_proj.weight":
        return mla.fused_a[qa + width :], w
    if part == "self_attn.kv_a_layernorm.weight":
        return mla.kv_norm, w[g0 * dc : g1 * dc]
    if part == "self_attn.kv_b_proj.weight":
        return mla.kv_b, heads(w).flatten(0, 1)
    if part == "self_attn.o_proj.weight":
        dv = m.v_head_dim
        return mla.o, w[:, h0 * dv : h1 * dv]
    return None


def _layer_slot(model, layer, part: str, w: torch.Tensor):
    """(destination view, source slice) for one decoder-layer tensor, or None if unknown."""
    cfg, tp, d = model.cfg, model.tp, model.cfg.head_dim
    q0, q1 = tp.shard(cfg.num_heads, "num_heads")
    k0, k1 = (0, 1) if cfg.mla else tp.shard(cfg.num_kv_heads, "num_kv_heads")
    i0, i1 = tp.shard(cfg.intermediate_size, "intermediate_size")
    nq, nk, inter = (q1 - q0) * d, (k1 - k0) * d, i1 - i0
    if part == "input_layernorm.weight":
        return layer.input_norm, w
    if part == "post_attention_layernorm.weight":
        return (layer.post_norm if layer.attn_out_norm is None else layer.attn_out_norm), w
    if layer.mla is not None and part.startswith("self_attn."):
        return _mla_slot(model, layer, part, w)
    if part not in _layer_parts(cfg):
        return None
    if part == "pre_feedforward_layernorm.weight":
        return layer.post_norm, w
    if part == "post_feedforward_layernorm.weight":
        return layer.mlp_out_norm, w
    if part in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        return (layer.q_norm if part.startswith("self_attn.q") else layer.k_norm), w
    if part.endswith("_proj.bias"):
        bias = layer.qkv_bias
        if part == "self_attn.q_proj.bias":
            return bias[:nq], w[q0 * d : q1 * d]
        rows = bias[nq : nq + nk] if part == "self_attn.k_proj.bias" else bias[nq + nk :]
        return rows, w[k0 * d : k1 * d]
    if part == "self_attn.qkv_proj.weight":
        full_q, full_k = cfg.num_heads * d, cfg.num_kv_heads * d
        q, k, v = w[:full_q], w[full_q : full_q + full_k], w[full_q + full_k :]
        return layer.qkv, torch.cat([q[q0 * d : q1 * d], k[k0 * d : k1 * d], v[k0 * d : k1 * d]])
    if part == "mlp.gate_up_proj.weight":
        gate, up = w.chunk(2)
        return layer.gate_up, torch.cat([gate[i0:i1], up[i0:i1]])
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
    parts = _layer_parts(cfg)
    pending |= {f"model.layers.{i}.{part}" for i in range(cfg.num_layers) for part in parts}
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
            raise ValueError(
                f"weight {name}: not a parameter of this {cfg.num_layers}-layer "
                f"{cfg.family.name} model"
            )
        if cfg.family.norm_plus_one and name.endswith("norm.weight"):
            slot = (slot[0], slot[1] + 1)
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
