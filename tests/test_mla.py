"""MLA (DeepSeek-V2/V3 attention) in the engine against HF transformers on tiny random
checkpoints: logits of a prompt and of decode steps, greedy outputs over chunk sizes and
with preemption, tensor parallelism, the absorbed decode against the expanded form, and
the checkpoints the engine refuses."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.attention import get_backend
from pdserve.engine.checkpoint import load_checkpoint
from pdserve.engine.config import ModelConfig
from pdserve.engine.model import LlamaModel
from tests.engine_utils import hf_greedy, prompt_logits, stepwise_logits
from tests.tiny_models import TINY_MLA_SHAPES

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _prompts(lengths=(5, 17, 40), seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(TINY_MLA_SHAPES))
def test_logits_match_hf_over_prompt_and_decode_steps(tiny_mla_model, name):
    path = tiny_mla_model(name)
    hf = _hf(path)
    llm = LLM(path, max_batch_tokens=64, num_kv_blocks=64)
    assert llm.engine.model.cpu_decode is None  # the Llama C decode layers stay off
    decode_steps = 8
    for ids in _prompts():
        full = ids + hf_greedy(hf, ids, decode_steps)
        with torch.no_grad():
            expected = hf(torch.tensor([full])).logits[0]
        torch.testing.assert_close(
            prompt_logits(llm.engine, ids), expected[: len(ids)], atol=1e-4, rtol=1e-4
        )
        got = stepwise_logits(llm.engine, full, len(ids))
        torch.testing.assert_close(got, expected[len(ids) - 1 :], atol=1e-4, rtol=1e-4)
    llm.engine.blocks.check_integrity()
    assert llm.engine.blocks.num_free_blocks == 64


@pytest.mark.timeout(120)
def test_bfloat16_matches_hf_bfloat16(tiny_mla_model):
    from transformers import AutoModelForCausalLM

    path = tiny_mla_model("v3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = LLM(path, dtype="bfloat16", max_batch_tokens=64, num_kv_blocks=64)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    for ids in _prompts():
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].float()
        got = prompt_logits(llm.engine, ids)
        torch.testing.assert_close(got, expected, atol=0.3, rtol=0.05)  # bf16 rounding
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
    out = llm.generate(_prompts()[0], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) == 8


@pytest.fixture(scope="module")
def hf_reference(tiny_mla_model):
    """name -> (path, prompts, HF's greedy continuation of each)."""
    made = {}

    def get(name: str):
        if name not in made:
            path, prompts = tiny_mla_model(name), _prompts()
            hf = _hf(path)
            made[name] = path, prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
        return made[name]

    return get


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["v3", "v3_q_proj"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_greedy_matches_hf_at_every_chunk_size(hf_reference, name, chunk):
    """Prompts of 5, 17 and 40 tokens together: chunks of ``chunk`` tokens beside the
    decodes of the others (64: whole prompts)."""
    path, prompts, expected = hf_reference(name)
    llm = LLM(path, max_batch_tokens=chunk, num_kv_blocks=64)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    llm.engine.blocks.check_integrity()
    assert llm.engine.blocks.num_free_blocks == 64


@pytest.mark.timeout(120)
def test_preempted_requests_recompute_to_hf_greedy(hf_reference):
    """12 blocks of 4 tokens for three requests that need 5, 8 and 12: requests are
    preempted (their latents dropped) and recomputed, and still match HF."""
    path, prompts, expected = hf_reference("v3")
    prompts, expected = prompts[:2] + [prompts[2][:30]], expected[:2]
    engine = LLMEngine(path, EngineConfig(max_batch_tokens=64, num_kv_blocks=12, block_size=4))
    requests = [engine.add_request(f"r{i}", ids, GREEDY) for i, ids in enumerate(prompts)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.blocks.check_integrity()
    assert sum(r.num_preemptions for r in requests) > 0
    assert [done["r0"], done["r1"]] == expected
    assert done["r2"] == hf_greedy(_hf(path), prompts[2], GREEDY.max_tokens)
    assert engine.blocks.num_free_blocks == 12


@pytest.mark.timeout(120)
def test_a_shared_prefix_reuses_cached_latent_blocks(tiny_mla_model):
    """The second prompt's first two blocks come from the prefix cache (latent rows the
    first request wrote); its greedy output is still HF's."""
    path = tiny_mla_model("v3")
    prefix = _prompts((32,), seed=3)[0]
    first, second = prefix + [5, 6, 7], prefix + [9, 10]
    llm = LLM(path, max_batch_tokens=64, num_kv_blocks=16)
    outs = [llm.generate(ids, GREEDY)[0] for ids in (first, second)]
    assert outs[1].num_cached_tokens == 32
    hf = _hf(path)
    assert [o.token_ids for o in outs] == [
        hf_greedy(hf, ids, GREEDY.max_tokens) for ids in (first, second)
    ]


@pytest.mark.timeout(180)
def test_tensor_parallel_2_equals_one_rank(hf_reference):
    """Query heads split over two ranks, the latent replicated on both."""
    path, prompts, expected = hf_reference("v3")
    with LLM(path, max_batch_tokens=16, num_kv_blocks=64, tensor_parallel=2) as llm:
        assert llm.engine.model.layers[0].mla.num_heads == 2
        assert llm.engine.runner.kv_cache.shape == (2, 64, 16, 32 + 16)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.timeout(120)
def test_an_instance_serves_it_and_reports_its_bytes_per_token(hf_reference):
    """The co-located worker (the pools' base) on an MLA model: ``ready()`` carries the
    latent cache's bytes per token, and the streamed tokens are HF's greedy ones."""
    from pdserve.instance.messages import Attempt
    from pdserve.instance.worker import EngineWorker

    path, prompts, expected = hf_reference("v3")
    worker = EngineWorker("colocated-0", path, {"num_kv_blocks": 32}, 1)
    try:
        assert worker.ready()["kv_cache_bytes_per_token"] == 2 * (32 + 16) * 4
        worker.add(Attempt("r0", tuple(prompts[1]), GREEDY, "test"))
        got, deadline = [], time.monotonic() + 60
        while len(got) < GREEDY.max_tokens:
            assert time.monotonic() < deadline, got
            for update in worker.poll("test", 1.0).updates:
                assert update.error is None, update.error
                got += update.token_ids
        assert got == expected[1]
        assert worker.check_integrity()["free_blocks"] == 32
    finally:
        worker.stop()


def test_latent_cache_layout_and_bytes_per_token(tiny_mla_model):
    llm = LLM(tiny_mla_model("v3"), num_kv_blocks=8, block_size=4)
    runner = llm.engine.runner
    # [layers, blocks, block size, kv_lora_rank + qk_rope_head_dim], float32
    assert runner.kv_cache.shape == (2, 8, 4, 48)
    assert runner.kv_bytes_per_token == 2 * 48 * 4


@pytest.mark.timeout(60)
def test_absorbed_decode_equals_expanded_on_the_same_cache(tiny_mla_model):
    from pdserve.engine.attention.latent_torch import paged_latent_decode

    mla = LLM(tiny_mla_model("v3_q_proj"), num_kv_blocks=8).engine.model.layers[1].mla
    g = torch.Generator().manual_seed(0)
    block_size, lens = 4, [1, 4, 5, 13]
    cache = torch.randn(12, block_size, mla.dc + mla.dr, generator=g)
    tables = torch.randperm(12, generator=g)[:12].view(3, 4)
    tables = torch.cat([tables, tables[:1].flip(1)]).to(torch.int32)
    q_nope = torch.randn(len(lens), mla.num_heads, mla.dn, generator=g)
    q_r = torch.randn(len(lens), mla.num_heads, mla.dr, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    absorbed = mla.absorbed(q_nope, q_r, cache, tables, seq_lens, paged_latent_decode)
    for b, n in enumerate(lens):
        expanded = mla.expanded(q_nope[b : b + 1], q_r[b : b + 1], cache, tables[b], n)
        torch.testing.assert_close(absorbed[b : b + 1], expanded, atol=1e-5, rtol=1e-5)


def test_a_mixture_of_experts_layer_is_refused(tiny_mla_model, tmp_path):
    folder = tmp_path / "moe"
    shutil.copytree(tiny_mla_model("v3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["first_k_dense_replace"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    refused = (
        r"first_k_dense_replace=1 with n_routed_experts=8.*"
        r"layers 1\.\.1 are mixtures of experts; supported are dense layers"
    )
    with pytest.raises(ValueError, match=refused):
        LLM(str(folder))
    config["first_k_dense_replace"], config["n_routed_experts"] = 0, None
    assert ModelConfig.from_hf(config).mla.kv_lora_rank == 32  # no experts: all dense


def test_an_unexpected_tensor_is_refused_by_name(tiny_mla_model):
    ckpt = load_checkpoint(tiny_mla_model("v3"))
    model = LlamaModel(ckpt.config, *get_backend("torch"))
    extra = ("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))
    refused = (
        r"weight model\.layers\.0\.self_attn\.k_proj\.weight: not a parameter of this 2-layer MLA"
    )
    with pytest.raises(ValueError, match=refused):
        model.load_weights([*ckpt.weights(torch.float32), extra])


def test_deepseek_v3_yarn_config_reads_as_hf_does():
    """DeepSeek-V3's own config.json keys (old-style ``rope_scaling`` with ``type``, the
    theta beside it): frequencies, cos/sin factor and softmax scale equal HF's."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from pdserve.engine.rope import attention_factor, inv_frequencies

    yarn = dict(type="yarn", factor=40, original_max_position_embeddings=4096, mscale=1.0,
                mscale_all_dim=1.0, beta_fast=32, beta_slow=1)  # fmt: skip
    shape = dict(hidden_size=256, num_attention_heads=2, kv_lora_rank=64, q_lora_rank=None,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 max_position_embeddings=163840, num_hidden_layers=1, intermediate_size=64,
                 first_k_dense_replace=1, vocab_size=32)  # fmt: skip
    ours = ModelConfig.from_hf(
        {
            **shape,
            "architectures": ["DeepseekV3ForCausalLM"],
            "rope_theta": 10000,
            "rope_scaling": yarn,
            "n_routed_experts": 256,
        }  # fmt: skip
    )
    hf_config = DeepseekV3Config(
        **shape, rope_parameters={**yarn, "rope_type": "yarn", "rope_theta": 10000.0}
    )
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    torch.testing.assert_close(
        inv_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling), inv
    )
    assert attention_factor(ours.rope_scaling) == pytest.approx(factor)
    assert ours.mla.softmax_scale == pytest.approx(DeepseekV3Attention(hf_config, 0).scaling)
    assert ours.mla.softmax_scale != pytest.approx(192**-0.5)  # mscale applied
