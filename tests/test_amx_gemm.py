"""The AMX projection (``engine/amx_gemm.py``) from a GGUF's Q4 / Q8 blocks, against
float64 products and, on the embedded model, against HF transformers."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.amx_gemm import amx_gemm
from pdserve.engine.checkpoint import alias_path
from pdserve.engine.cpu_gemm import F32, MAX_ROWS, Q4, Q8, PanelWeight, cpu_gemm
from pdserve.engine.linear import linear
from tests.engine_utils import gguf_blocks, prompt_logits

pytestmark = pytest.mark.skipif(
    amx_gemm() is None,
    reason="no AMX here (CPU, compiler or kernel): the panel kernel takes every batch",
)

# |y - y64| <= BOUND * (|x| @ |W|.T), elementwise: float32 GEMMs stay inside it (MKL's
# reaches ~6e-7 on these shapes), and a product short of x's third bfloat16 part does not
BOUND = 8e-7


def twin(w: torch.Tensor) -> PanelWeight:
    return PanelWeight(cpu_gemm(), w, amx=amx_gemm())


def scaled_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    return ((y.double() - exact).abs() / scale).max().item()


def wide_range(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Activations whose magnitudes span 2^-20 .. 2^20, so that every part of the split
    carries weight."""
    return torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-20, 21, (m, k), generator=g)


@pytest.mark.parametrize(("kind", "fmt"), [("Q4_1", Q4), ("Q8_0", Q8)])
@pytest.mark.parametrize("m", [MAX_ROWS + 1, 80, 129, 300])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (47, 96), (100, 576), (960, 64)])
def test_matches_float64_within_float32_rounding(kind, fmt, m, n, k):
    """Part tiles of rows (m % 16), part panels of columns (n % 48), one or many blocks."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = gguf_blocks(torch.randn(n, k, generator=g) * 0.05, kind)
    weight = twin(w)
    assert weight.format == fmt
    for x in (torch.randn(m, k, generator=g), wide_range(m, k, g)):
        assert weight.supports(x)
        y = weight(x)
        assert scaled_error(y, x, w) < BOUND
        assert scaled_error(torch.nn.functional.linear(x, w), x, w) < BOUND


def test_blocks_far_from_zero():
    """Weights whose blocks sit far from zero next to their spread: the centring integer
    of each block is clamped, and the products stay exact."""
    g = torch.Generator().manual_seed(7)
    w = gguf_blocks(3 + 0.01 * torch.randn(96, 128, generator=g), "Q4_1")
    w[:48] *= -1
    weight = twin(w)
    assert weight.format == Q4
    for x in (torch.randn(70, 128, generator=g), wide_range(70, 128, g)):
        assert scaled_error(weight(x), x, w) < BOUND


def test_the_bound_catches_a_part_left_out():
    """The same check, on the products of x's first two bfloat16 parts only: what the
    kernel would compute without the third."""
    g = torch.Generator().manual_seed(3)
    x, w = wide_range(100, 256, g), gguf_blocks(torch.randn(64, 256, generator=g), "Q4_1")
    hi = x.bfloat16().float()
    two_parts = hi + (x - hi).bfloat16().float()
    assert scaled_error(two_parts.double() @ w.double().T, x, w) > 2 * BOUND


def test_a_row_is_the_same_whatever_the_batch():
    """Each row of y comes from its own row of x, bit for bit, whatever else is in the
    batch and wherever the row falls in a tile."""
    g = torch.Generator().manual_seed(4)
    w = gguf_blocks(torch.randn(200, 320, generator=g) * 0.05, "Q4_1")
    x = torch.randn(300, 320, generator=g)
    weight = twin(w)
    whole = weight(x)
    for lo, hi in ((0, MAX_ROWS + 1), (5, 90), (211, 300)):
        assert torch.equal(weight(x[lo:hi].contiguous()), whole[lo:hi])


def test_reads_strided_rows():
    g = torch.Generator().manual_seed(5)
    w = gguf_blocks(torch.randn(96, 64, generator=g) * 0.05, "Q8_0")
    wide = torch.randn(100, 160, generator=g)
    x = wide[:, 32:96]
    assert x.stride(0) == 160
    assert torch.equal(twin(w)(x), twin(w)(x.contiguous()))


def test_linear_takes_amx_for_large_batches_of_blocks_only():
    g = torch.Generator().manual_seed(6)
    blocks = twin(gguf_blocks(torch.randn(64, 64, generator=g) * 0.05, "Q4_1"))
    floats = twin(torch.randn(64, 64, generator=g))
    plain = PanelWeight(cpu_gemm(), blocks.weight)  # no AMX kernel given
    big, small = torch.randn(MAX_ROWS + 1, 64, generator=g), torch.randn(MAX_ROWS, 64)
    assert blocks.format == Q4 and floats.format == F32
    # above MAX_ROWS the blocks take AMX (another order of the same products), the float
    # panels and small batches the panel kernel
    assert not torch.equal(linear(big, blocks.weight, panels=blocks), plain(big))
    assert torch.equal(linear(small, blocks.weight, panels=blocks), plain(small))
    assert torch.equal(linear(big, floats.weight, panels=floats), floats(big))
    assert scaled_error(blocks(big), big, blocks.weight) < BOUND


def test_embedded_model_prefills_on_amx_like_hf():
    """A prompt past MAX_ROWS tokens: every layer's projections run on AMX, and the
    logits are transformers' own on the same GGUF."""
    from transformers import AutoModelForCausalLM

    gguf = alias_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    llm = LLM("smollm2-135m", num_kv_blocks=64, max_batch_tokens=512)
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 12
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 2 * MAX_ROWS
    got = prompt_logits(llm.engine, ids)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    for layer in llm.engine.model.layers:
        assert all(t.format == Q4 and t.amx is not None for t in layer.panels.values())
