"""The C projection (``engine/cpu_gemm.py``) on each ISA the CPU has, against float64
products, against itself (whatever the batch) and against the other ISAs, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import native
from pdserve.engine.cpu_gemm import F32, Q4, Q8, CpuGemm, PanelWeight, cpu_gemm
from pdserve.engine.linear import linear
from pdserve.engine.ops import TorchOps
from tests.engine_utils import gguf_blocks

# every test on each ISA the CPU has (tests/conftest.py isa)
pytestmark = pytest.mark.usefixtures("isa")
# rows that take each path: the direct one (1 .. 4), the tiled one with part tiles,
# and prefill-sized batches
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 13, 64, 65, 300]


def panels(w: torch.Tensor, **kwargs) -> PanelWeight:
    return PanelWeight(cpu_gemm(), w, **kwargs)


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|y - x @ w.T| within float32 accumulation's reach of the float64 product."""
    exact = x.double() @ w.double().T
    bound = 4e-7 * x.shape[1] * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", [1, 5, 16, 47, 48, 49, 100])
@pytest.mark.parametrize("k", [1, 15, 16, 33, 576])
def test_matches_float64(m, n, k):
    """Odd sizes: part tiles of rows, part panels of columns, any K."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    check_close(panels(w)(x), x, w)


def test_panels_hold_the_weight_by_columns():
    w = torch.randn(50, 7)
    p = panels(w).panels
    width = cpu_gemm().width
    assert width == {"avx2": 32, "avx512": 48, "amx": 48}[native.isa()]
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
    check_close(twin(x), x, w)


@pytest.mark.parametrize("fmt", [F32, Q4, Q8])
def test_a_row_is_the_same_whatever_the_batch(fmt):
    """Each output is computed the same way for any M, direct or tiled, decode batch or
    prefill chunk: batch-invariant, bit for bit."""
    kind = {Q4: "Q4_1", Q8: "Q8_0"}.get(fmt)
    w = torch.randn(1000, 320) * 0.05
    twin = panels(gguf_blocks(w, kind) if kind else w)
    assert twin.format == fmt
    x = torch.randn(300, 320)
    whole = twin(x)
    for lo, hi in ((0, 1), (0, 2), (0, 3), (0, 4), (3, 8), (0, 33), (40, 41), (100, 300)):
        assert torch.equal(twin(x[lo:hi].contiguous()), whole[lo:hi])


def test_isas_agree_bit_for_bit(monkeypatch):
    """Every ISA the CPU has gives the same floats: one chain of multiply-adds per
    output, in k order, whatever the vector width and the panel layout."""
    have = [name for name in native.supported() if native.library(name) is not None]
    if len(have) < 2:
        pytest.skip(f"one ISA here ({', '.join(have)}): nothing to compare")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 576, generator=g) * 0.05
    weights = {"F32": w, "Q4": gguf_blocks(w, "Q4_1"), "Q8": gguf_blocks(w, "Q8_0")}
    x = torch.randn(70, 576, generator=g)
    results = {}
    for name in have:
        monkeypatch.setenv(native.ENV, name)
        results[name] = {
            kind: [panels(wk)(x[:m].contiguous()) for m in (1, 3, 4, 8, 70)]
            for kind, wk in weights.items()
        }
    first, *rest = have
    for name in rest:
        for kind in weights:
            for a, b in zip(results[first][kind], results[name][kind], strict=True):
                assert torch.equal(a, b), (first, name, kind, a.shape)


def test_linear_takes_panels_for_float32_matrices():
    w = torch.randn(8, 16)
    twin = panels(w)
    for m in (1, 64, 65, 2048):
        assert twin.supports(torch.randn(m, 16))
    assert not twin.supports(torch.randn(2, 16, dtype=torch.float64))
    assert not twin.supports(torch.randn(16, 2).T)
    assert not twin.supports(torch.randn(0, 16))
    assert not CpuGemm.supports(w.double()) and not CpuGemm.supports(w.T)
    for m in (3, 300):
        x = torch.randn(m, 16)
        assert torch.equal(linear(x, w, panels=twin), twin(x))
    wide = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(linear(wide, w.double(), panels=twin), wide @ w.double().T)


@pytest.mark.parametrize(("kind", "fmt"), [("Q4_1", Q4), ("Q8_0", Q8)])
@pytest.mark.parametrize("n", [1, 47, 100, 960])
def test_gguf_blocks_are_stored_as_blocks_and_give_the_float32_products(kind, fmt, n):
    """Weights that are a GGUF's blocks pack as those blocks, and every product is the
    float32 layout's, bit for bit, for any batch."""
    g = torch.Generator().manual_seed(n)
    w = gguf_blocks(torch.randn(n, 320, generator=g) * 0.05, kind)
    blocks, floats = panels(w), panels(w, formats=())
    assert blocks.panels.nbytes < floats.panels.nbytes / 3
    assert (blocks.format, floats.format) == (fmt, F32)
    for m in (1, 4, 7, 9, 33, 64, 200):
        x = torch.randn(m, 320, generator=g)
        assert torch.equal(blocks(x), floats(x))
        check_close(blocks(x), x, w)


def test_anything_but_exact_blocks_stays_float32():
    w = gguf_blocks(torch.randn(96, 64) * 0.05, "Q4_1")
    assert panels(w).format == Q4
    nudged = w.clone()
    nudged[50, 40] = torch.nextafter(nudged[50, 40], torch.tensor(1.0))
    assert panels(nudged).format == F32
    assert panels(w[:, :48]).format == F32  # a shard that cuts through the blocks
    assert panels(torch.randn(96, 64)).format == F32
    assert panels(torch.zeros(96, 64)).format == Q4


@pytest.mark.parametrize("fmt", [F32, Q4, Q8])
def test_fused_silu_mul_is_the_projection_then_the_op(fmt):
    """The gate/up projection fused with SiLU x up (``gemm_silu_mul_f32``) gives the very
    floats of the projection followed by the separate pass, at part tiles, whole row
    blocks and outputs streamed past the caches (above 256 rows)."""
    kind = {Q4: "Q4_1", Q8: "Q8_0"}.get(fmt)
    half = 2 * cpu_gemm().width
    g = torch.Generator().manual_seed(fmt)
    w = torch.randn(2 * half, 320, generator=g) * 0.05
    twin = panels(gguf_blocks(w, kind) if kind else w)
    assert twin.format == fmt
    for m in (5, 13, 64, 256, 300, 700):
        x = torch.randn(m, 320, generator=g)
        assert twin.fuses_silu_mul(x)
        assert torch.equal(twin.silu_mul(x), TorchOps().silu_and_mul(twin(x)))


def test_fused_silu_mul_only_where_it_runs():
    """Not below the tiled path's rows, nor where gate and up are not whole panels each."""
    width = cpu_gemm().width
    twin = panels(torch.randn(2 * width, 32))
    assert twin.fuses_silu_mul(torch.randn(5, 32))
    assert not twin.fuses_silu_mul(torch.randn(4, 32))  # the direct path's batch
    assert not twin.fuses_silu_mul(torch.randn(16, 32, dtype=torch.float64))
    assert not panels(torch.randn(2 * width + 2, 32)).fuses_silu_mul(torch.randn(9, 32))
