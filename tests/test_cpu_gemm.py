"""The small-batch C projection (``engine/cpu_gemm.py``) against torch's matmul."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_gemm import F32, MAX_ROWS, Q4, Q8, CpuGemm, PanelWeight, cpu_gemm
from engine.linear import linear
from tests.engine_utils import gguf_blocks

pytestmark = pytest.mark.skipif(cpu_gemm() is None, reason="no C compiler: the fallback runs")


def panels(w: torch.Tensor) -> PanelWeight:
    return PanelWeight(cpu_gemm(), w)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 13, MAX_ROWS])
@pytest.mark.parametrize("n", [1, 5, 16, 47, 48, 49, 100])
@pytest.mark.parametrize("k", [1, 15, 16, 33, 576])
def test_matches_matmul(m, n, k):
    """Odd sizes: part tiles of rows, part panels of columns, any K."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    torch.testing.assert_close(panels(w)(x), x @ w.T, rtol=1e-5, atol=1e-5 * k**0.5)


def test_panels_hold_the_weight_by_columns():
    w = torch.randn(50, 7)
    p = panels(w).panels
    width = cpu_gemm().width
    assert p.shape == (-(-50 // width), 7, width)
    full = p.permute(0, 2, 1).reshape(-1, 7)
    assert torch.equal(full[:50], w) and not full[50:].any()


def test_packs_on_first_use_only():
    w = torch.randn(96, 32)
    twin = panels(w)
    assert twin._panels is None
    twin(torch.randn(2, 32))
    first = twin._panels
    twin(torch.randn(3, 32))
    assert twin._panels is first


def test_reads_strided_rows_and_weights():
    """x may be a column slice of a wider tensor, and W a row slice (a shard)."""
    wide, w_wide = torch.randn(6, 80), torch.randn(30, 64)
    x, w = wide[:, 16:64], w_wide[:, 8:56]
    twin = panels(w)
    assert twin.supports(x)
    torch.testing.assert_close(twin(x), x @ w.T, rtol=1e-5, atol=1e-4)


def test_a_row_is_the_same_whatever_the_batch():
    """Each output is computed the same way for any M: batch-invariant, bit for bit."""
    x, w = torch.randn(MAX_ROWS, 300), torch.randn(1000, 300)
    twin = panels(w)
    whole = twin(x)
    for m in (1, 2, 5, 8, 33):
        assert torch.equal(twin(x[:m].contiguous()), whole[:m])
    assert torch.equal(twin(x[40:41].contiguous()), whole[40:41])


def test_linear_takes_panels_for_small_float32_batches_only():
    w = torch.randn(8, 16)
    twin = panels(w)
    assert twin.supports(torch.randn(MAX_ROWS, 16))
    assert not twin.supports(torch.randn(MAX_ROWS + 1, 16))
    assert not twin.supports(torch.randn(2, 16, dtype=torch.float64))
    assert not twin.supports(torch.randn(16, 2).T)
    assert not CpuGemm.supports(w.double()) and not CpuGemm.supports(w.T)
    x = torch.randn(3, 16)
    assert torch.equal(linear(x, w, panels=twin), twin(x))
    big = torch.randn(MAX_ROWS + 1, 16)
    assert torch.equal(linear(big, w, panels=twin), torch.nn.functional.linear(big, w))


@pytest.mark.parametrize(("kind", "fmt"), [("Q4_1", Q4), ("Q8_0", Q8)])
@pytest.mark.parametrize("n", [1, 47, 100, 960])
def test_gguf_blocks_are_stored_as_blocks_and_give_the_float32_products(kind, fmt, n):
    """Weights that are a GGUF's blocks pack as those blocks, and every product is the
    float32 layout's, bit for bit, for any batch."""
    g = torch.Generator().manual_seed(n)
    w = gguf_blocks(torch.randn(n, 320, generator=g) * 0.05, kind)
    blocks, floats = panels(w), PanelWeight(cpu_gemm(), w, formats=())
    assert blocks.panels.nbytes < floats.panels.nbytes / 3
    assert (blocks.format, floats.format) == (fmt, F32)
    for m in (1, 7, 9, 33, MAX_ROWS):
        x = torch.randn(m, 320, generator=g)
        assert torch.equal(blocks(x), floats(x))
        torch.testing.assert_close(blocks(x), x @ w.T, rtol=1e-5, atol=1e-4)


def test_anything_but_exact_blocks_stays_float32():
    w = gguf_blocks(torch.randn(96, 64) * 0.05, "Q4_1")
    assert panels(w).format == Q4
    nudged = w.clone()
    nudged[50, 40] = torch.nextafter(nudged[50, 40], torch.tensor(1.0))
    assert panels(nudged).format == F32
    assert panels(w[:, :48]).format == F32  # a shard that cuts through the blocks
    assert panels(torch.randn(96, 64)).format == F32
    assert panels(torch.zeros(96, 64)).format == Q4
