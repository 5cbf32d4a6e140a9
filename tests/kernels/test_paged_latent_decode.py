"""The latent decode kernel (MLA / GLA / GTA, absorbed form) against its reference, and
the reference against a dense computation without pages."""

import pytest
import torch
from paged_cases import DEVICE, DTYPES, TOLERANCES, dtype_id, nan_like

from pdserve.kernels.paged_latent_decode import paged_latent_decode, ref_paged_latent_decode
from tests.latent_cases import dense_latent_decode, latent_queries, paged_latent

# lengths on, just before and just after block edges of 16, odd ones, several blocks
LENGTHS = [1, 15, 16, 17, 33, 47, 64, 71, 300]
# (H, Hc): MLA (one latent head) and GLA / GTA with 2-4 latent or tied heads
HEAD_LAYOUTS = [(8, 1), (4, 2), (9, 3), (16, 4)]
DR = 64


def layout_id(heads):
    return f"{heads[0]}q{heads[1]}c"


def _run(seq_lens, heads, dc, dk, dtype, num_splits=None):
    h, hc = heads
    case = paged_latent(seq_lens, 16, hc, dc, DR, dtype, DEVICE)
    q_c, q_r = latent_queries(len(seq_lens), h, dk, DR, dtype, DEVICE)
    scale = (dk + DR) ** -0.5
    args = (q_c, q_r, case.c_cache, case.r_cache, case.block_tables, case.seq_lens, scale)
    # out: a strided view, as in a wider buffer
    out = nan_like(torch.empty(len(seq_lens), h, dc + 16, dtype=dtype, device=DEVICE))[..., :dc]
    paged_latent_decode(*args, max(seq_lens), num_splits, out=out)
    torch.testing.assert_close(out, ref_paged_latent_decode(*args), **TOLERANCES[dtype])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("dk_part", [1, 2], ids=["dk=dc", "dk=dc/2"])
@pytest.mark.parametrize("dc", [256, 512])
def test_matches_reference(dc, dk_part, heads, dtype):
    _run(LENGTHS, heads, dc, dc // dk_part, dtype)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("num_splits", [2, 3])
def test_context_splits(num_splits):
    """Split boundaries inside blocks and past short sequences; a group of 20 query
    heads spans two head tiles."""
    _run([1, 31, 100, 161], (20, 1), 256, 256, torch.float32, num_splits)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_long_context_mla_shape(dtype):
    """DeepSeek-V3's latent (512 + 64) under 128 query heads, long contexts."""
    _run([2047, 4096, 33], (128, 1), 512, 512, dtype)


@pytest.mark.parametrize("dk_part", [1, 2], ids=["dk=dc", "dk=dc/2"])
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=layout_id)
def test_reference_matches_dense(heads, dk_part):
    """The paged reference equals SDPA over each sequence's unpaged [c | r] keys."""
    h, hc = heads
    dc, dk = 256, 256 // dk_part
    case = paged_latent([1, 16, 17, 40], 16, hc, dc, DR, torch.float32)
    q_c, q_r = latent_queries(4, h, dk, DR, torch.float32)
    ref = ref_paged_latent_decode(
        q_c, q_r, case.c_cache, case.r_cache, case.block_tables, case.seq_lens, 0.1
    )
    torch.testing.assert_close(ref, dense_latent_decode(q_c, q_r, case.rows, hc, dc, 0.1))


def test_rejects_bad_arguments():
    case = paged_latent([5], 16, 2, 256, DR, torch.float32, DEVICE)
    q_c, q_r = latent_queries(1, 4, 256, DR, torch.float32, DEVICE)
    args = [q_c, q_r, case.c_cache, case.r_cache, case.block_tables, case.seq_lens, 1.0]

    def call(i, x, match):
        with pytest.raises(ValueError, match=match):
            paged_latent_decode(*args[:i], x, *args[i + 1 :])

    call(0, torch.randn(1, 3, 256, device=DEVICE), "q_c")  # 3 heads, 2 latent heads
    call(0, torch.randn(1, 4, 512, device=DEVICE), "c_cache")  # Dk > Dc
    call(3, case.r_cache[..., :32], "r_cache")
    call(3, case.r_cache.half(), "r_cache")
    call(4, case.block_tables.long(), "block_tables")
    call(5, case.seq_lens.long(), "seq_lens")
    with pytest.raises(ValueError, match="out"):
        paged_latent_decode(*args, out=torch.empty(1, 4, 128, device=DEVICE))
