"""Latent and tied attention over a paged cache: MLA (DeepSeek-V2/V3), GLA and GTA
(engine/mla_config.py), one module.

Shapes, per tensor-parallel rank holding H of the model's query heads and Hc of its
latent/tied heads (MLA's one latent is replicated: every rank computes and caches it):
    Dc = kv_lora_rank, Dr = qk_rope_head_dim, dn = qk_nope_head_dim, dv = v_head_dim
    fused_a  [Rq + Hc * Dc + Dr, hidden]  q_a_proj rows, then these latent heads' rows of
                                     kv_a_proj_with_mqa and its Dr RoPE rows (without a
                                     low-rank query: q_proj's rows of these heads,
                                     H * (dn + Dr), in place of Rq)
    q_b      [H * (dn + Dr), Rq]     these heads' rows of q_b_proj (low-rank query only)
    kv_norm  [Hc * Dc]               RMS norm of each latent head on its own (not GTA)
    kv_b     [H * (dn + dv), Dc]     per query head W_UK [dn, Dc] then W_UV [dv, Dc], on
                                     its group's latent head (not GTA)
    o        [hidden, H * dv]
    cache    [num_blocks, block_size, Hc * Dc + Dr] one layer's cache: each token's
             latent/tied heads, then its RoPE key (the shared interface)
Query head h reads latent head h // (H / Hc). GTA has no up-projection: its key is the
first dn = Dc / 2 floats of the tied state then the RoPE key, its value the whole state.
The RoPE rows of q and of the key come out in rotate-half order: for an interleaved
checkpoint the loader permutes those rows (engine/weight_map.py), which leaves every
score unchanged.

Prefill rows run expanded: the sequence's cached latents are up-projected by kv_b
into per-head K (then the shared RoPE key) and V, and attended causally. Decode rows
run absorbed: q_c = q_nope @ W_UK per head, the backend's ``paged_latent_decode``
over the cache, then W_UV on its output (GTA: q_c = q_nope, the output as it is).
Both compute the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import latent_decode_op
from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.linear import linear
from pdserve.engine.ops import Ops
from pdserve.engine.parallel import TensorParallel

# HF's DeepSeek norms of the low-rank query and of the latent use their default eps
LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        m = cfg.mla
        h0, h1 = tp.shard(cfg.num_heads, "num_heads")
        g0, g1 = (0, 1) if m.replicated else tp.shard(m.latent_heads, "num_kv_heads")
        self.num_heads, self.latent_heads, self.latent_range = h1 - h0, g1 - g0, (g0, g1)
        self.dn, self.dr, self.dv, self.dc = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        )
        self.q_rank, self.tied = m.q_lora_rank, m.tied
        q_width = self.num_heads * (self.dn + self.dr)
        self.q_a_width = q_width if m.q_lora_rank is None else m.q_lora_rank
        self.cache_width = self.latent_heads * self.dc + self.dr
        self.scale = m.softmax_scale

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.fused_a = param(self.q_a_width + self.cache_width, cfg.hidden_size)
        if m.q_lora_rank is not None:
            self.q_a_norm = param(m.q_lora_rank)
            self.q_b = param(q_width, m.q_lora_rank)
        if not m.tied:
            self.kv_norm = param(self.latent_heads * self.dc)
            self.kv_b = param(self.num_heads * (self.dn + self.dv), self.dc)
        self.o = param(cfg.hidden_size, self.num_heads * self.dv)
        self.projections = ("fused_a", "o") if m.q_lora_rank is None else ("fused_a", "q_b", "o")
        self.panels: dict = {}

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return linear(x, getattr(self, name), self.panels.get(name))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        attn_name: str,
        ops: Ops,
    ) -> torch.Tensor:
        """x [T, hidden] (normed) -> this rank's o_proj partial sum [T, hidden]; writes
        the T new tokens' rows into ``cache`` at ``meta.slot_mapping`` first."""
        t, h, latent_width = x.shape[0], self.num_heads, self.cache_width - self.dr
        q_a, latent, k_r = self.project("fused_a", x).split(
            [self.q_a_width, latent_width, self.dr], -1
        )
        q = q_a
        if self.q_rank is not None:
            q = self.project("q_b", ops.rms_norm(q_a, self.q_a_norm, LATENT_NORM_EPS))
        q = q.view(t, h, self.dn + self.dr)
        q_r, k_r = ops.rotary(q[..., self.dn :].contiguous(), k_r.reshape(t, 1, self.dr), rope)
        if not self.tied:
            latent = self._norm_heads(latent)
        rows = torch.cat([latent, k_r[:, 0]], -1).to(cache.dtype)
        cache.view(-1, self.cache_width).index_copy_(0, meta.slot_mapping, rows)
        q_nope = q[..., : self.dn]
        out = x.new_empty(t, h, self.dv)
        start = 0
        for i in range(meta.num_prefills):
            n, context = meta.query_lens_host[i], meta.seq_lens_host[i]
            rows_i, table = slice(start, start + n), meta.block_tables[i]
            out[rows_i] = self.expanded(q_nope[rows_i], q_r[rows_i], cache, table, context)
            start += n
        if meta.num_decodes:
            first = meta.num_prefills
            out[start:] = self.absorbed(
                q_nope[start:],
                q_r[start:],
                cache,
                meta.block_tables[first:],
                meta.seq_lens[first:],
                latent_decode_op(attn_name),
            )
        return self.project("o", out.view(t, h * self.dv))

    def _norm_heads(self, latent: torch.Tensor) -> torch.Tensor:
        """RMS norm of each latent head of latent [T, Hc * Dc] over its own Dc floats."""
        x = latent.float().unflatten(-1, (self.latent_heads, self.dc))
        x = x * x.pow(2).mean(-1, keepdim=True).add_(LATENT_NORM_EPS).rsqrt_()
        return (
            (x * self.kv_norm.float().view(self.latent_heads, self.dc)).flatten(1).to(latent.dtype)
        )

    def expanded(self, q_nope, q_r, cache, table, context: int) -> torch.Tensor:
        """One sequence's n newest tokens (at positions context - n .. context - 1)
        against its first ``context`` cached rows, K and V up-projected per head:
        q_nope [n, H, dn], q_r [n, H, Dr], table [>= ceil(context / block_size)] ->
        [n, H, dv]."""
        n, h, hc = q_nope.shape[0], self.num_heads, self.latent_heads
        blocks = table[: -(-context // cache.shape[1])].long()
        rows = cache[blocks].flatten(0, 1)[:context]  # [context, Hc * Dc + Dr]
        c = rows[:, : hc * self.dc].unflatten(-1, (hc, self.dc))
        k_r = rows[:, None, hc * self.dc :]
        if self.tied:  # K: the state's first dn floats and the RoPE key; V: the state
            k, v = torch.cat([c[..., : self.dn], k_r.expand(context, hc, self.dr)], -1), c
        else:  # head j of group g up-projects latent g
            w = self.kv_b.view(hc, h // hc, self.dn + self.dv, self.dc)
            kv = torch.einsum("tgc,gjec->tgje", c, w).flatten(1, 2)
            k_nope, v = kv.split([self.dn, self.dv], -1)
            k = torch.cat([k_nope, k_r.expand(context, h, self.dr)], -1)
        q = torch.cat([q_nope, q_r], -1).transpose(0, 1)
        positions = torch.arange(context - n, context, device=q.device).unsqueeze(1)
        mask = torch.arange(context, device=q.device).unsqueeze(0) <= positions
        out = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)

    def absorbed(self, q_nope, q_r, cache, block_tables, seq_lens, decode) -> torch.Tensor:
        """One new token per sequence, W_UK folded into the query and W_UV applied after
        ``decode`` (a ``paged_latent_decode``): q_nope [B, H, dn], q_r [B, H, Dr],
        block_tables [B, M] int32, seq_lens [B] int32 -> [B, H, dv]."""
        width = self.latent_heads * self.dc
        c_cache = cache[..., :width].unflatten(-1, (self.latent_heads, self.dc))
        r_cache = cache[..., width:]
        if self.tied:
            return decode(
                q_nope.contiguous(),
                q_r.contiguous(),
                c_cache,
                r_cache,
                block_tables,
                seq_lens,
                self.scale,
            )
        w = self.kv_b.view(self.num_heads, self.dn + self.dv, self.dc)
        q_c = torch.bmm(q_nope.transpose(0, 1), w[:, : self.dn]).transpose(0, 1)
        latent = decode(
            q_c.contiguous(), q_r.contiguous(), c_cache, r_cache, block_tables, seq_lens, self.scale
        )
        return torch.bmm(latent.transpose(0, 1), w[:, self.dn :].transpose(1, 2)).transpose(0, 1)
