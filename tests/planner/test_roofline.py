"""The roofline cost model and the model shapes, checked by hand."""

import pytest

from pdserve.engine.config import ModelConfig
from pdserve.planner.hardware import Hardware, get_hardware, this_cpu
from pdserve.planner.model_shape import PRESETS, ModelShape, get_model
from pdserve.planner.roofline import RooflineCost

TOY = ModelShape(
    "toy",
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
    dtype_bytes=2,
)
HW = Hardware(
    "toy",
    peak_flops=1e3,
    mem_bandwidth=1e3,
    mem_bytes=1e6,
    tp_bandwidth=100,
    kv_bandwidth=1e3,
    tp_latency_s=0,
    kv_latency_s=0,
    compute_eff=1,
    mem_eff=1,
)


def test_shape_counts():
    # attention: q and o 8x8 each, k and v 8x4 each = 192; MLP 3 x 8 x 16 = 384
    assert TOY.layer_params == 192 + 384
    assert TOY.params == 2 * 576 + 80
    assert TOY.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    assert TOY.tp_degrees(8) == [1]


def test_presets_and_sources():
    assert 12.5e9 < PRESETS["opt-13b"].params < 13.2e9
    assert 7.4e9 < PRESETS["llama-3-8b"].params < 8.1e9
    assert 68e9 < PRESETS["llama-3-70b"].params < 71e9
    assert PRESETS["smollm2-135m"].kv_bytes_per_token == 46080  # configs' comment: 46 KB
    assert get_model("OPT-13B", "float32").dtype_bytes == 4
    hf = {
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
    }
    shape = ModelShape.from_hf(hf, "llama-3-8b")
    assert shape == PRESETS["llama-3-8b"]
    assert ModelShape.from_model_config(ModelConfig.from_hf(hf), "llama-3-8b") == shape
    with pytest.raises(ValueError, match="preset"):
        get_model("nope")


def test_prefill_compute_bound():
    cost = RooflineCost(TOY, HW)
    flops = 2 * TOY.params * 100 + 2 * 2 * 2 * 2 * 4 * 100**2 / 2
    assert cost.prefill_s(100, 100**2) == pytest.approx(flops / 1e3)
    assert cost.prefill_s(0, 0) == 0


def test_decode_memory_bound_and_tp():
    hw = Hardware("m", 1e12, 1e3, 1e6, 100, 1e3, 0, 0, compute_eff=1, mem_eff=1)
    cost = RooflineCost(TOY, hw)
    nbytes = TOY.weight_bytes + (50 + 1) * TOY.kv_bytes_per_token
    assert cost.decode_s(1, 50) == pytest.approx(nbytes / 1e3, rel=1e-6)
    # tp 2: half the bytes per device, plus 2 all-reduces per layer of [1, 8] x 2 bytes
    comm = 2 * TOY.num_layers * (2 * 1 / 2 * 16 / 100)
    assert cost.decode_s(1, 50, tp=2) == pytest.approx(nbytes / 2e3 + comm, rel=1e-6)


def test_kv_transfer_and_capacity():
    cost = RooflineCost(TOY, HW)
    assert cost.transfer_s(500) == pytest.approx(0.5)
    assert cost.kv_capacity_tokens(1) == int((0.9e6 - TOY.weight_bytes) // 32)
    big = RooflineCost(get_model("opt-175b"), get_hardware("a100"))
    assert big.kv_capacity_tokens(1) == 0 and big.kv_capacity_tokens(8) > 0


def test_a100_opt13b_magnitudes():
    cost = RooflineCost(get_model("opt-13b"), get_hardware("a100"))
    # a 512-token prefill is compute-bound (tens of ms), a small decode step memory-bound
    assert 0.03 < cost.prefill_s(512, 512**2) < 0.15
    assert 0.01 < cost.decode_s(1, 512) < 0.02
    assert cost.prefill_s(512, 512**2, tp=2) < cost.prefill_s(512, 512**2)


def test_this_cpu_measured():
    hw = this_cpu(threads=1)
    assert hw.peak_flops > 1e8 and hw.mem_bandwidth > 1e8 and not hw.gpu
    cost = RooflineCost(get_model("smollm2-135m"), hw)
    assert 0 < cost.decode_s(1, 100) < cost.prefill_s(512, 512**2)
