"""The C latent decode (MLA / GLA / GTA, absorbed form) against the dense computation
over each sequence's unpaged [c | r] keys (which tests/kernels checks equal to
``ref_paged_latent_decode``), its context spans and thread counts, and its refusals."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import native
from pdserve.engine.attention.cpu_latent import paged_latent_decode
from tests.latent_cases import dense_latent_decode, latent_queries, paged_latent

# on each ISA the CPU has (tests/conftest.py isa)
needs_kernel = pytest.mark.usefixtures("isa")
DR = 64
# (H, Hc): MLA with small and wide groups, GLA / GTA with 2-4 latent heads, odd groups
HEAD_LAYOUTS = [(8, 1), (128, 1), (4, 2), (6, 2), (9, 3), (16, 4)]


def _check(seq_lens, block_size, heads, dc, dk, threads=None):
    h, hc = heads
    case = paged_latent(seq_lens, block_size, hc, dc, DR, torch.float32)
    q_c, q_r = latent_queries(len(seq_lens), h, dk, DR, torch.float32)
    scale = (dk + DR) ** -0.5
    args = (q_c, q_r, case.c_cache, case.r_cache, case.block_tables, case.seq_lens, scale)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or before)
        out = paged_latent_decode(*args)
    finally:
        torch.set_num_threads(before)
    want = dense_latent_decode(q_c, q_r, case.rows, hc, dc, scale)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=lambda x: f"{x[0]}q{x[1]}c")
@pytest.mark.parametrize("dk_part", [1, 2], ids=["dk=dc", "dk=dc/2"])
@pytest.mark.parametrize("dc", [256, 512])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_dense(block_size, dc, dk_part, heads):
    bs = block_size
    _check([1, bs - 1, bs, bs + 1, 2 * bs + 1, 300, 1000], bs, heads, dc, dc // dk_part)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("seq_lens", [[1000], [1, 700], [257, 5, 513]], ids=str)
def test_context_spans(seq_lens, threads):
    """Few sequences split their context into spans (some empty for the short ones)
    merged afterwards; the result does not depend on the split."""
    _check(seq_lens, 16, (16, 1), 512, 512, threads)
    _check(seq_lens, 16, (8, 2), 256, 128, threads)


@needs_kernel
def test_refuses_what_it_does_not_run():
    case = paged_latent([5], 16, 1, 256, DR, torch.float32)
    q_c, q_r = latent_queries(1, 4, 256, DR, torch.float32)
    rest = (case.block_tables, case.seq_lens, 1.0)
    half = [x.half() for x in (q_c, q_r, case.c_cache, case.r_cache)]
    assert paged_latent_decode(*half, *rest) is None
    odd = paged_latent([5], 16, 1, 72, DR, torch.float32)  # Dc not a multiple of 16
    assert paged_latent_decode(q_c[..., :72], q_r, odd.c_cache, odd.r_cache, *rest) is None
    assert paged_latent_decode(q_c, q_r, case.c_cache, case.r_cache, *rest) is not None


@pytest.mark.parametrize("fallback", [True, False])
def test_none_without_the_library(monkeypatch, fallback):
    """No library: None (the caller's torch path runs); with one, a result."""
    if not fallback and native.library() is None:
        pytest.skip("no C compiler")
    if fallback:  # no ISA of engine/native.py: no library, as without a compiler
        monkeypatch.setattr(native, "isa", lambda: None)
    case = paged_latent([3], 16, 1, 256, DR, torch.float32)
    q_c, q_r = latent_queries(1, 4, 256, DR, torch.float32)
    out = paged_latent_decode(
        q_c, q_r, case.c_cache, case.r_cache, case.block_tables, case.seq_lens, 1.0
    )
    assert (out is None) == fallback


@needs_kernel
@pytest.mark.parametrize(
    "bad, message",
    [
        ({"q_r": torch.zeros(2, 3, DR)}, "q_c .* and q_r"),
        ({"q_c": torch.zeros(2, 3, 256), "q_r": torch.zeros(2, 3, DR)}, "Hc dividing 3"),
        ({"q_c": torch.zeros(2, 4, 512)}, "Dc >= Dk = 512"),
        ({"r_cache": torch.zeros(4, 16, 32)}, "r_cache"),
        ({"block_tables": torch.zeros(2, 4, dtype=torch.int64)}, "must be int32"),
        ({"seq_lens": torch.ones(3, dtype=torch.int32)}, "2 sequences"),
    ],
)
def test_refuses_shapes_it_would_read_past(bad, message):
    args = {
        "q_c": torch.zeros(2, 4, 256),
        "q_r": torch.zeros(2, 4, DR),
        "c_cache": torch.zeros(4, 16, 2, 256),
        "r_cache": torch.zeros(4, 16, DR),
        "block_tables": torch.zeros(2, 4, dtype=torch.int32),
        "seq_lens": torch.ones(2, dtype=torch.int32),
    }
    with pytest.raises(ValueError, match=message):
        paged_latent_decode(**{**args, **bad}, scale=0.125)
