"""MKL's packed GEMM (engine/mkl_packed.py) against F.linear, and the engine on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.linear import linear
from engine.mkl_packed import MklPacker, PackedWeight, mkl_packer
from tests.engine_utils import hf_greedy

PACKER = mkl_packer()
pytestmark = pytest.mark.skipif(PACKER is None, reason="torch without MKL: F.linear runs")


@pytest.mark.parametrize("rows", [65, 130, 512])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 37)])
def test_packed_equals_f_linear(shape, rows):
    weight = torch.randn(*shape)
    packed = PackedWeight(PACKER, weight)
    x = torch.randn(rows, shape[1])
    # the same products, summed over k in another order for some shapes
    torch.testing.assert_close(packed(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    wide = torch.randn(rows, shape[1] + 3)[:, 1 : shape[1] + 1]  # rows further apart
    torch.testing.assert_close(packed(wide), F.linear(wide, weight), rtol=1e-5, atol=1e-4)
    assert torch.equal(linear(x, weight, packed), packed(x))


def test_small_batches_and_other_inputs_skip_the_packed_weight():
    weight = torch.randn(64, 32)
    packed = PackedWeight(PACKER, weight)
    assert not packed.supports(torch.randn(8, 33))
    assert not packed.supports(torch.randn(32, 8).t())  # not unit stride along in
    assert not packed.supports(torch.randn(8, 32, dtype=torch.bfloat16))
    assert not MklPacker.supports(torch.randn(32, 64).t())
    with pytest.raises(ValueError, match="contiguous 2-D float32"):
        PackedWeight(PACKER, weight.to(torch.bfloat16))
    x = torch.randn(3, 32)
    torch.testing.assert_close(packed(x), F.linear(x, weight))


def test_engine_prefills_on_packed_weights_like_hf(tiny_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model("gqa3")
    llm = LLM(path, max_batch_tokens=512, num_kv_blocks=64)
    packed = llm.engine.model.layers[0].packed
    assert set(packed) == {"qkv", "o", "gate_up", "down"}
    assert all(p.buffer is None for p in packed.values())  # packed on the first prefill
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (70, 200)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, ids, 12)
    assert all(p.buffer is not None for p in packed.values())
