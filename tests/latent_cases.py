"""Paged latent / tied KV caches for the latent decode tests (Triton and C kernels).

The cache is one allocation ``[num_layers, num_blocks, block_size, Hc * Dc + Dr]`` as
the engine allocates it; the kernels get one layer's two strided views of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LatentCase:
    """c_cache [N, bs, Hc, Dc] and r_cache [N, bs, Dr]: views of layer ``layer`` of
    ``latent_cache``; ``rows[i]`` [seq_lens[i], Hc * Dc + Dr] is sequence i's cached
    tokens in order (the dense truth the blocks were filled from)."""

    latent_cache: torch.Tensor
    c_cache: torch.Tensor
    r_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    rows: list[torch.Tensor]


def latent_views(latent_cache: torch.Tensor, layer: int, hc: int, dc: int):
    """Layer ``layer``'s (c_cache, r_cache) views of a latent cache, as the contract says."""
    c_cache = latent_cache[layer, ..., : hc * dc].unflatten(-1, (hc, dc))
    return c_cache, latent_cache[layer, ..., hc * dc :]


def paged_latent(seq_lens, block_size, hc, dc, dr, dtype, device="cpu", num_layers=3, layer=1):
    """A LatentCase holding random tokens for each sequence in shuffled blocks.

    Every other element of the allocation is NaN: slots past each sequence's length,
    unused blocks, block 0 (where padding entries of the block tables point), and every
    other layer, so a kernel that reads any of them, or mixes up the views' strides,
    fails its test.
    """
    width = hc * dc + dr
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    cache = torch.full((num_layers, num_blocks, block_size, width), float("nan"), dtype=dtype)
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32)
    rows = []
    for i, n in enumerate(seq_lens):
        ids = [free.pop() for _ in range(per_seq[i])]
        tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        seq_rows = torch.randn(n, width, dtype=dtype)
        for t in range(0, n, block_size):
            chunk = seq_rows[t : t + block_size]
            cache[layer, ids[t // block_size], : len(chunk)] = chunk
        rows.append(seq_rows.to(device))
    cache = cache.to(device)
    c_cache, r_cache = latent_views(cache, layer, hc, dc)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return LatentCase(cache, c_cache, r_cache, tables.to(device), lens, rows)


def latent_queries(b, h, dk, dr, dtype, device="cpu"):
    """(q_c [b, h, dk], q_r [b, h, dr]): strided views of one [b, h, dk + dr] tensor,
    as a fused query projection produces them."""
    q = torch.randn(b, h, dk + dr, dtype=dtype, device=device)
    return q[..., :dk], q[..., dk:]


def dense_latent_decode(q_c, q_r, rows, hc, dc, scale):
    """The latent decode without pages: for each sequence, SDPA of [q_c | q_r] over the
    concatenated keys [c[:, :Dk] | r] with values c, each query head on its latent head.
    float32 out [B, H, Dc]."""
    h, dk = q_c.shape[1:]
    outs = []
    for i, seq_rows in enumerate(rows):
        c = seq_rows[:, : hc * dc].unflatten(-1, (hc, dc)).float().transpose(0, 1)  # [Hc, n, Dc]
        r = seq_rows[:, hc * dc :].float()  # [n, Dr]
        keys = torch.cat([c[..., :dk], r.expand(hc, -1, -1)], dim=-1)  # [Hc, n, Dk + Dr]
        # [Hc, G, Dk + Dr]: a group's query heads as the query rows of its latent head
        q = torch.cat([q_c[i], q_r[i]], dim=-1).float().unflatten(0, (hc, h // hc))
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, c, scale=scale)
        outs.append(out.flatten(0, 1))
    return torch.stack(outs)
