"""The small-batch C projection (``engine/cpu_gemm.py``) against torch's matmul."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_gemm import MAX_ROWS, CpuGemm, cpu_gemm

pytestmark = pytest.mark.skipif(cpu_gemm() is None, reason="no C compiler: the fallback runs")


@pytest.mark.parametrize("m", [1, 2, 3, 7, 13, MAX_ROWS])
@pytest.mark.parametrize("n", [1, 5, 8, 17, 100])
@pytest.mark.parametrize("k", [1, 15, 16, 33, 576])
def test_matches_matmul(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    torch.testing.assert_close(cpu_gemm()(x, w), x @ w.T, rtol=1e-5, atol=1e-5 * k**0.5)


def test_reads_strided_rows():
    """x may be a column slice of a wider tensor (rows apart by its stride)."""
    wide, w = torch.randn(6, 80), torch.randn(24, 48)
    x = wide[:, 16:64]
    assert CpuGemm.supports(x, w)
    torch.testing.assert_close(cpu_gemm()(x, w), x @ w.T, rtol=1e-5, atol=1e-4)


def test_a_row_is_the_same_whatever_the_batch():
    """Each output is computed the same way for any M: batch-invariant, bit for bit."""
    x, w = torch.randn(MAX_ROWS, 300), torch.randn(1000, 300)
    whole = cpu_gemm()(x, w)
    for m in (1, 2, 5, 33):
        assert torch.equal(cpu_gemm()(x[:m].contiguous(), w), whole[:m])
    assert torch.equal(cpu_gemm()(x[40:41].contiguous(), w), whole[40:41])


def test_supports_only_small_float32_batches():
    w = torch.randn(8, 16)
    assert CpuGemm.supports(torch.randn(MAX_ROWS, 16), w)
    assert not CpuGemm.supports(torch.randn(MAX_ROWS + 1, 16), w)
    assert not CpuGemm.supports(torch.randn(2, 16, dtype=torch.float64), w.double())
    assert not CpuGemm.supports(torch.randn(16, 2).T, w)
