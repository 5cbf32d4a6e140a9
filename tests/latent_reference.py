"""Tiny random GLA and GTA checkpoints, and a plain torch reference of their forward pass
written from the definitions of "Hardware-Efficient Attention for Fast Decoding"
(Zadouri, Strauss, Dao; arXiv 2505.21487), independent of the engine's code.

The definitions used (per layer; h query heads, x a token's normed hidden state):
  GLA  c = kv_a(x) holds h_c latent heads c_1..c_{h_c} of d_c floats, each RMS-normed on
       its own, and one RoPE key k_R = RoPE(kv_a(x) rope rows) of d_R floats;
       query head i (low-rank: q = q_b(norm(q_a(x)))) splits into q_i^C (d_nope) and
       q_i^R = RoPE(.) (d_R); with g = i // (h / h_c) its group's latent:
         k_i = [W_UK_i c_g ; k_R],  v_i = W_UV_i c_g  (W_UK_i, W_UV_i: head i's rows of kv_b)
         o_i = softmax(scale * q_i . k_i over the causal past) v_i
  GTA  one tied state s_g = W_KV,g x of d_h floats per group g of query heads, one
       single-head RoPE key k_R = RoPE(W_KR x) of d_h / 2 floats; query head i =
       [q_i^C (d_h / 2) ; RoPE(q_i^R) (d_h / 2)]; with g its group:
         k_i = [s_g[: d_h / 2] ; k_R],  v_i = s_g,  scale = d_h^-0.5
RoPE rotates halves (rotate-half); the MLP is Llama's SiLU-gated one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

LAYERS, HIDDEN, INTER, VOCAB = 2, 64, 96, 256


def _base_config(arch: str, heads: int) -> dict:
    return dict(
        architectures=[arch], vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=LAYERS, num_attention_heads=heads, max_position_embeddings=1024,
        rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip


def save_tiny_gla(folder: Path, latent_heads: int, heads: int = 8, seed: int = 0) -> None:
    """GLA-``latent_heads``: d_c 16 per latent head, d_nope 8, d_R 8, d_v 8, q rank 32."""
    config = _base_config("GLAForCausalLM", heads) | dict(
        num_latent_heads=latent_heads, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, rope_interleave=False,
    )  # fmt: skip
    attention = {
        "q_a_proj": (32, HIDDEN),
        "q_a_layernorm": (32,),
        "q_b_proj": (heads * 16, 32),
        "kv_a_proj_with_mqa": (latent_heads * 16 + 8, HIDDEN),
        "kv_a_layernorm": (latent_heads * 16,),
        "kv_b_proj": (heads * 16, 16),
        "o_proj": (HIDDEN, heads * 8),
    }
    _save(folder, config, attention, seed)


def save_tiny_gta(folder: Path, groups: int, heads: int = 8, seed: int = 0) -> None:
    """GTA with ``groups`` tied states of d_h 16 (8 of them the key's RoPE half)."""
    config = _base_config("GTAForCausalLM", heads) | dict(num_key_value_heads=groups, head_dim=16)
    attention = {
        "q_proj": (heads * 16, HIDDEN),
        "kv_proj": (groups * 16, HIDDEN),
        "k_rope_proj": (8, HIDDEN),
        "o_proj": (HIDDEN, heads * 16),
    }
    _save(folder, config, attention, seed)


def _save(folder: Path, config: dict, attention: dict, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}  # fmt: skip
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        shapes |= {layer + n: (HIDDEN,) for n in ("input_layernorm.weight",
                                                   "post_attention_layernorm.weight")}  # fmt: skip
        shapes |= {f"{layer}mlp.{p}_proj.weight": (INTER, HIDDEN) for p in ("gate", "up")}
        shapes[f"{layer}mlp.down_proj.weight"] = (HIDDEN, INTER)
        shapes |= {f"{layer}self_attn.{n}.weight": s for n, s in attention.items()}
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.rand(shape, generator=g) + 0.5
        else:
            tensors[name] = torch.randn(shape, generator=g) * 0.15
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [T, ..., d] at positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv
    cos = torch.cat([angles.cos(), angles.cos()], -1).float()
    sin = torch.cat([angles.sin(), angles.sin()], -1).float()
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attend(q_i, k_i, v_i, scale):
    """One head over the causal past: q_i, k_i [T, d_k], v_i [T, d_v] -> [T, d_v]."""
    t = q_i.shape[0]
    scores = scale * q_i @ k_i.T
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v_i


def _gla(x, w, cfg, positions):
    t, h, hc = x.shape[0], cfg["num_attention_heads"], cfg["num_latent_heads"]
    dc, dn, dr, dv = (cfg[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                       "v_head_dim"))  # fmt: skip
    q = (_rms(x @ w["q_a_proj"].T, w["q_a_layernorm"]) @ w["q_b_proj"].T).view(t, h, dn + dr)
    a = x @ w["kv_a_proj_with_mqa"].T
    c = _rms(a[:, : hc * dc].view(t, hc, dc), w["kv_a_layernorm"].view(hc, dc))
    k_r = _rope(a[:, hc * dc :], positions, cfg["rope_theta"])
    q_r = _rope(q[..., dn:], positions, cfg["rope_theta"])
    kv_b = w["kv_b_proj"].view(h, dn + dv, dc)
    out = []
    for i in range(h):
        g = i // (h // hc)
        k_i = torch.cat([c[:, g] @ kv_b[i, :dn].T, k_r], -1)
        v_i = c[:, g] @ kv_b[i, dn:].T
        out.append(_attend(torch.cat([q[:, i, :dn], q_r[:, i]], -1), k_i, v_i, (dn + dr) ** -0.5))
    return torch.cat(out, -1)


def _gta(x, w, cfg, positions):
    t, h, groups = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["head_dim"]
    q = (x @ w["q_proj"].T).view(t, h, d)
    s = (x @ w["kv_proj"].T).view(t, groups, d)
    k_r = _rope(x @ w["k_rope_proj"].T, positions, cfg["rope_theta"])
    q_r = _rope(q[..., d // 2 :], positions, cfg["rope_theta"])
    out = []
    for i in range(h):
        g = i // (h // groups)
        k_i = torch.cat([s[:, g, : d // 2], k_r], -1)
        out.append(_attend(torch.cat([q[:, i, : d // 2], q_r[:, i]], -1), k_i, s[:, g], d**-0.5))
    return torch.cat(out, -1)


def reference_logits(folder: str, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of every position, the whole sequence at once."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    attention = _gta if cfg["architectures"][0] == "GTAForCausalLM" else _gla
    positions = torch.arange(len(ids))
    h = tensors["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        w = {
            k.removesuffix(".weight").rsplit(".", 1)[-1]: v
            for k, v in tensors.items()
            if k.startswith(prefix)
        }
        x = _rms(h, w["input_layernorm"])
        h = h + attention(x, w, cfg, positions) @ w["o_proj"].T
        x = _rms(h, w["post_attention_layernorm"])
        h = h + (F.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T
    return _rms(h, tensors["model.norm.weight"]) @ tensors["lm_head.weight"].T


def reference_greedy(folder: str, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, the whole sequence recomputed for each."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(reference_logits(folder, ids + out)[-1].argmax()))
    return out
