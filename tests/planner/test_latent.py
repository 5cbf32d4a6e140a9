"""Latent and tied attention in the planner (MLA, GLA, GTA; arXiv 2505.21487), by hand."""

import pytest

from pdserve.cluster.cli import main
from pdserve.planner.attention import GroupedAttention, LatentAttention
from pdserve.planner.cluster_spec import ClusterSpec, PoolSpec
from pdserve.planner.hardware import Hardware
from pdserve.planner.model_shape import PRESETS, ModelShape, get_model
from pdserve.planner.roofline import RooflineCost
from pdserve.planner.simulator import simulate

D = 128  # d_h


def one_layer(latent=None, kv_heads=16):
    """One bf16 layer of 16 query heads of d_h (the paper's Table 5 per-layer figures)."""
    head_dim = D + D // 2 if latent else D
    return ModelShape("t", 1, 2048, 16, kv_heads, head_dim, 4096, 100, latent=latent)


MLA = LatentAttention(1, 4 * D, D // 2, 4 * D, D, D)
GLA2 = LatentAttention(2, 2 * D, D // 2, 2 * D, D, D)
GTA4 = LatentAttention(4, D, D // 2, D // 2, D // 2, D, up_projected=False)


def test_paper_table5_bytes_per_token_per_device():
    # Table 5 (1.471B model: 16 heads of d_h 128, RoPE d_h/2 = 64): bytes a token, one layer
    # TP=1 / TP=2: MHA 8192/4096, GQA-4 2048/1024, GTA-4 1152/640, GLA-2 1152/640,
    # MLA 1152/1152
    cases = {
        "mha": (one_layer(kv_heads=16), 8192, 4096),
        "gqa-4": (one_layer(kv_heads=4), 2048, 1024),
        "gta-4": (one_layer(GTA4), 1152, 640),
        "gla-2": (one_layer(GLA2), 1152, 640),
        "mla": (one_layer(MLA), 1152, 1152),
    }
    for name, (shape, tp1, tp2) in cases.items():
        assert (shape.kv_bytes_per_device(1), shape.kv_bytes_per_device(2)) == (tp1, tp2), name


def test_deepseek_v3_dense_presets():
    mla = get_model("deepseek-v3-dense")
    # 61 layers x (512 latent + 64 RoPE) x 2 bytes, on every rank whatever the degree
    assert [mla.kv_bytes_per_device(t) for t in (1, 2, 4, 8)] == [61 * 576 * 2] * 4
    assert mla.kv_bytes_per_instance(8) == 8 * 61 * 576 * 2
    gla2, gla4 = get_model("deepseek-v3-dense-gla-2"), get_model("deepseek-v3-dense-gla-4")
    assert gla2.kv_bytes_per_token == mla.kv_bytes_per_token  # h_c = 2 of 2 d_h: MLA's size
    assert gla4.kv_bytes_per_token == 61 * (4 * 256 + 64) * 2  # twice the latent
    assert [gla2.kv_bytes_per_device(t) for t in (1, 2)] == [61 * 2 * s for s in (576, 320)]
    assert [gla4.kv_bytes_per_device(t) for t in (1, 2, 4)] == [
        61 * 2 * s for s in (1088, 576, 320)
    ]
    # latent heads shard as the engine shards them: a degree must divide them
    assert gla2.tp_degrees(8) == [1, 2] and gla4.tp_degrees(8) == [1, 2, 4]
    with pytest.raises(ValueError, match="tensor_parallel=4 with 2 latent heads"):
        gla2.kv_bytes_per_device(4)
    gta, gqa = get_model("deepseek-v3-dense-gta-8"), get_model("deepseek-v3-dense-gqa-8")
    # the paper's discussion: GTA-8 at TP 8 stores 1.5 d_h a token, GQA-8 2 d_h; at TP 4
    # 2.5 d_h against 4 d_h
    assert gta.kv_bytes_per_device(8) == 61 * 2 * 192 and gqa.kv_bytes_per_device(8) == 61 * 2 * 256
    assert gta.kv_bytes_per_device(4) == 61 * 2 * 320 and gqa.kv_bytes_per_device(4) == 61 * 2 * 512
    assert gta.kv_bytes_per_token == gqa.kv_bytes_per_token / 2 + 61 * 2 * 64  # half + RoPE
    for name in ("deepseek-v3-dense", "deepseek-v3-dense-gta-8", "deepseek-v3-dense-gqa-8"):
        assert PRESETS[name].tp_degrees(8) == [1, 2, 4, 8]
    # the attention dims as published: q_a 7168x1536, q_b 1536x128x192, kv_a 7168x576,
    # kv_b 512x128x256, o 128x128x7168; a dense MLP of 3 x 7168 x 18432 in 61 layers
    attn = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert mla.layer_params == attn + 3 * 7168 * 18432
    assert mla.params == 61 * mla.layer_params + 129280 * 7168
    # GLA-2: the same query, a down projection to 2 x 256 + 64, up projections of 256 for
    # 64 heads each; GTA-8: a plain query, the tied states and the RoPE key, no up
    q_lora = 7168 * 1536 + 1536 * 128 * 192
    gla_attn = q_lora + 7168 * 576 + 2 * 256 * 64 * 256 + 128 * 128 * 7168
    assert gla2.layer_params - 3 * 7168 * 18432 == gla_attn
    gta_attn = 7168 * 128 * 128 + 7168 * (8 * 128 + 64) + 128 * 128 * 7168
    assert gta.layer_params - 3 * 7168 * 18432 == gta_attn


def test_transfer_bytes_per_decode_degree():
    mla, gla2 = get_model("deepseek-v3-dense"), get_model("deepseek-v3-dense-gla-2")
    mha = get_model("deepseek-v3-dense-mha")
    row = 61 * 2  # layers x bf16
    # MLA: one latent copy per decode instance, whatever its degree
    assert {mla.kv_transfer_bytes(1024, t) for t in (1, 2, 4)} == {1024 * row * 576}
    # GLA-2: each decode rank its own latent heads and one RoPE key
    assert gla2.kv_transfer_bytes(1024, 2) == 1024 * row * (2 * 256 + 2 * 64)
    gla4 = get_model("deepseek-v3-dense-gla-4")
    assert gla4.kv_transfer_bytes(1024, 4) == 1024 * row * (4 * 256 + 4 * 64)
    # per-head K/V: every head once, any degree
    assert {mha.kv_transfer_bytes(1024, t) for t in (1, 2, 8)} == {1024 * row * 2 * 128 * 128}


def test_arithmetic_intensity_as_the_paper_states():
    mha, gqa = GroupedAttention(128, 128), GroupedAttention(8, 128)
    assert mha.arithmetic_intensity(1, 128, 2) == 1  # ~1
    assert gqa.arithmetic_intensity(1, 128, 2) == 16  # ~g_q
    no_rope = LatentAttention(1, 512, 0, 512, 128, 128)
    assert no_rope.arithmetic_intensity(1, 128, 2) == 2 * 128  # MLA ~2 h_q
    gla2 = LatentAttention(2, 256, 0, 256, 128, 128)
    assert gla2.arithmetic_intensity(1, 128, 2) == 128  # GLA-2 ~h_q (2 g_q)
    gta8 = LatentAttention(8, 128, 0, 64, 64, 128, up_projected=False)
    # GTA: ~2 g_q, less the key's half that is not read from the tied state
    assert gta8.arithmetic_intensity(1, 128, 2) == pytest.approx(2 * 16 * (64 + 128) / 256)
    # MLA under tp 8: every rank reads the whole latent for its 16 query heads
    assert no_rope.arithmetic_intensity(8, 128, 2) == 2 * 16


def test_roofline_counts_latent_bytes_and_absorbed_flops():
    shape = one_layer(MLA)
    hw = Hardware("m", 1e15, 1e3, 1e9, 1e12, 1e3, 0, 0, compute_eff=1, mem_eff=1)
    cost = RooflineCost(shape, hw)
    row = (512 + 64) * 2
    nbytes = shape.weight_bytes + (1000 + 1) * row
    assert cost.decode_s(1, 1000) == pytest.approx(nbytes / 1e3, rel=1e-9)
    # tp 2: the weights split, the latent does not (read whole on each rank)
    comm = cost.allreduce_s(1, 2)
    assert cost.decode_s(1, 1000, tp=2) == pytest.approx(
        shape.weight_bytes / 2e3 + 1001 * row / 1e3 + comm, rel=1e-9
    )
    compute = RooflineCost(shape, Hardware("c", 1e3, 1e15, 1e9, 1e12, 1e3, 0, 0, 1, 1))
    # absorbed decode: 2 x 16 heads x (512 scores + 64 RoPE + 512 sum) FLOPs a pair
    flops = 2 * shape.params + 2 * 16 * (512 + 64 + 512) * 1000
    assert compute.decode_s(1, 1000) == pytest.approx(flops / 1e3)
    # expanded prefill: keys of 128 + 64, values of 128
    flops = 2 * shape.params * 10 + 2 * 16 * (128 + 64 + 128) * 100 / 2
    assert compute.prefill_s(10, 100) == pytest.approx(flops / 1e3)
    free = 2 * 0.9e9 - shape.weight_bytes
    assert cost.kv_capacity_tokens(2) == int(free // (2 * row))


def test_simulated_mla_handoff_moves_one_copy_whatever_the_decode_degree():
    shape = one_layer(MLA)
    hw = Hardware("m", 1e15, 1e12, 1e9, 1e12, 1e6, 0, 0, compute_eff=1, mem_eff=1)
    cost = RooflineCost(shape, hw)
    for tp in (1, 2):
        cluster = ClusterSpec("disaggregated", PoolSpec(), PoolSpec(tp=tp), layerwise=False)
        [r] = simulate(cluster, cost, [(0.0, 100, 2)])
        assert r.kv_bytes == 100 * (512 + 64) * 2  # decode rank 0 forwards it to the rest
        assert r.transfer_ms == pytest.approx(r.kv_bytes / 1e6 * 1000)


def test_from_hf_deepseek_and_moe_refused():
    cfg = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "vocab_size": 100,
        "q_lora_rank": 24,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "first_k_dense_replace": 2,
    }
    shape = ModelShape.from_hf(cfg, "tiny")
    assert shape.latent == LatentAttention(1, 32, 8, 32, 16, 16, 24)
    assert shape.kv_bytes_per_device(2) == 2 * (32 + 8) * 2
    with pytest.raises(ValueError, match="first_k_dense_replace=1 < num_hidden_layers=2"):
        ModelShape.from_hf({**cfg, "first_k_dense_replace": 1}, "tiny")


@pytest.mark.timeout(120)
def test_plan_deepseek_v3_dense(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    args = ["plan", "--model", "deepseek-v3-dense", "--devices", "8", "--hardware", "h200"]
    args += ["--samples", "60", "--duration", "20", "--verify", "1", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "winner:" in text and out.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mla", "gla-2", "gta-2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_engines_own_latent_models_plan_with_the_bytes_they_allocate(tmp_path, kind, tp):
    """``ModelShape.from_model_config`` (how a served profile's model reaches the planner)
    of the engine's tiny MLA / GLA / GTA checkpoints: per-device KV bytes per token equal
    the bytes the engine's cache holds per token on one rank."""
    from pdserve.engine.llm import LLM
    from tests.latent_reference import save_tiny_gla, save_tiny_gta
    from tests.tiny_models import save_tiny_deepseek

    {"mla": lambda: save_tiny_deepseek(tmp_path, q_lora_rank=32),
     "gla-2": lambda: save_tiny_gla(tmp_path, 2),
     "gta-2": lambda: save_tiny_gta(tmp_path, 2)}[kind]()  # fmt: skip
    with LLM(str(tmp_path), num_kv_blocks=4, tensor_parallel=tp) as llm:
        cache = llm.engine.runner.kv_cache  # rank 0's [layers, blocks, block size, row]
        shape = ModelShape.from_model_config(llm.engine.model.cfg, dtype="float32")
        assert shape.latent is not None
        per_token = cache.shape[0] * cache.shape[-1] * cache.element_size()
        assert shape.kv_bytes_per_device(tp) == per_token
