"""The torch ``paged_latent_decode`` (engine/attention/latent_torch.py) against its
definition computed one (sequence, head) at a time, on strided views of one latent cache
[N, block_size, Hc * Dc + Dr] as the engine allocates it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.latent_torch import paged_latent_decode


def _by_definition(q_c, q_r, c_cache, r_cache, tables, lens, scale):
    b, h, dk = q_c.shape
    _, block_size, hc, dc = c_cache.shape
    out = torch.empty(b, h, dc)
    for i in range(b):
        n = int(lens[i])
        slots = [(int(tables[i, t // block_size]), t % block_size) for t in range(n)]
        for j in range(h):
            k = j // (h // hc)
            c = torch.stack([c_cache[blk, off, k].double() for blk, off in slots])
            r = torch.stack([r_cache[blk, off].double() for blk, off in slots])
            scores = scale * (c[:, :dk] @ q_c[i, j].double() + r @ q_r[i, j].double())
            out[i, j] = (scores.softmax(0) @ c).float()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("latent_heads", "query_heads", "dc", "dk"),
    [(1, 4, 32, 32), (2, 4, 32, 32), (4, 8, 16, 16), (2, 6, 32, 16), (1, 3, 48, 24)],
)
def test_matches_the_definition(dtype, latent_heads, query_heads, dc, dk):
    """Hc latent heads shared by groups of query heads, Dk <= Dc (GTA's half-width key),
    lengths across block boundaries, padding entries in the tables."""
    g = torch.Generator().manual_seed(latent_heads * 100 + dk)
    block_size, dr, num_blocks = 4, 8, 16
    cache = torch.randn(num_blocks, block_size, latent_heads * dc + dr, generator=g).to(dtype)
    c_cache = cache[..., : latent_heads * dc].unflatten(-1, (latent_heads, dc))
    r_cache = cache[..., latent_heads * dc :]
    lens = torch.tensor([1, 4, 5, 13, 16], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:4] for _ in lens])
    tables[0, 1:] = 0  # padding past the length is never read
    tables = tables.to(torch.int32)
    q_c = torch.randn(len(lens), query_heads, dk, generator=g).to(dtype)
    q_r = torch.randn(len(lens), query_heads, dr, generator=g).to(dtype)
    scale = (dk + dr) ** -0.5
    got = paged_latent_decode(q_c, q_r, c_cache, r_cache, tables, lens, scale)
    assert got.dtype == dtype and got.shape == (len(lens), query_heads, dc)
    want = _by_definition(q_c, q_r, c_cache, r_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_refuses_query_heads_that_do_not_group():
    cache = torch.zeros(2, 4, 2 * 16 + 8)
    c_cache, r_cache = cache[..., :32].unflatten(-1, (2, 16)), cache[..., 32:]
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="H a multiple of Hc"):
        paged_latent_decode(
            torch.zeros(1, 3, 16), torch.zeros(1, 3, 8), c_cache, r_cache, one.view(1, 1), one, 1.0
        )
