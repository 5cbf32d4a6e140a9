"""Paged decode attention over a latent/tied KV cache, in plain torch (batched gathers).

The reference of the shared signature that the Triton kernel
(``kernels/paged_latent_decode.py``) implements too, and the op of the torch backend.

    paged_latent_decode(q_c, q_r, c_cache, r_cache, block_tables, seq_lens, scale) -> out

    q_c           [B, H, Dk]    the query in latent space, Dk <= Dc
    q_r           [B, H, Dr]    the query's RoPE part
    c_cache       [N, bs, Hc, Dc] strided view of the cache rows' latent heads
    r_cache       [N, bs, Dr]   strided view of the rows' RoPE key (one for all heads)
    block_tables  [B, M] int32  blocks of each sequence; entries past
                                ceil(seq_lens[b] / bs) are padding, never read
    seq_lens      [B] int32     tokens in the cache, the new one included (>= 1)
    scale         float
    out           [B, H, Dc]    in q_c's dtype

Query head h reads latent head h // (H // Hc), and for t < seq_lens[b]:
    score[b, h, t] = scale * (q_c[b, h] . c[t, hc, :Dk] + q_r[b, h] . r[t])
    out[b, h] = sum_t softmax_t(score[b, h]) * c[t, hc, :]
accumulated in float32.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention import cpu_latent


def paged_latent_decode(
    q_c: torch.Tensor,
    q_r: torch.Tensor,
    c_cache: torch.Tensor,
    r_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    b, h, dk = q_c.shape
    _, block_size, hc, dc = c_cache.shape
    if h % hc or dk > dc or q_r.shape != (b, h, r_cache.shape[-1]):
        raise ValueError(
            f"paged_latent_decode: q_c {tuple(q_c.shape)}, q_r {tuple(q_r.shape)} do not fit "
            f"c_cache {tuple(c_cache.shape)}, r_cache {tuple(r_cache.shape)} (H a multiple of "
            "Hc, Dk <= Dc, q_r [B, H, Dr])"
        )
    width = block_tables.shape[1] * block_size
    ids = block_tables.long()
    # [B, width, Hc, Dc] and [B, width, Dr]: each sequence's blocks in order
    c = c_cache[ids].flatten(1, 2).float()
    r = r_cache[ids].flatten(1, 2).float()
    group = h // hc
    qc = q_c.float().view(b, hc, group, dk)
    scores = torch.einsum("bkgd,btkd->bkgt", qc, c[..., :dk])
    scores += torch.einsum("bkgd,btd->bkgt", q_r.float().view(b, hc, group, -1), r)
    scores *= scale
    valid = torch.arange(width, device=q_c.device).view(1, 1, 1, -1) < seq_lens.view(-1, 1, 1, 1)
    probs = scores.masked_fill(~valid, float("-inf")).softmax(-1)
    out = torch.einsum("bkgt,btkd->bkgd", probs, c)
    return out.reshape(b, h, dc).to(q_c.dtype)


def cpu_or_torch_latent_decode(q_c, q_r, c_cache, r_cache, block_tables, seq_lens, scale):
    """The torch backend's op: the C kernel (``cpu_latent.py``) where it takes the inputs
    (float32 on CPU, widths multiples of 16, a compiler present), else the batched torch
    path above; both compute the function the module docstring defines."""
    out = cpu_latent.paged_latent_decode(q_c, q_r, c_cache, r_cache, block_tables, seq_lens, scale)
    if out is None:
        out = paged_latent_decode(q_c, q_r, c_cache, r_cache, block_tables, seq_lens, scale)
    return out
