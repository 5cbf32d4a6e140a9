"""Every family of engine/families.py against HF transformers on tiny random checkpoints
(tests/family_models.py): logits over a prompt and decode steps, greedy outputs at every
chunk size, with preemption and at tensor parallelism 2; sliding windows and Gemma 2's
score cap where they bite; and the checkpoints the engine refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams, native
from pdserve.engine.config import ModelConfig
from pdserve.engine.families import SUPPORTED_ARCHITECTURES
from tests.engine_utils import hf_greedy, prompt_logits, stepwise_logits

FAMILIES = ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _prompts(lengths=(5, 17, 40), seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _check_logits(path: str, prompts: list[list[int]], decode_steps: int = 8) -> LLM:
    """The engine's logits of each prompt and of ``decode_steps`` decode steps after it
    are HF's to 1e-4."""
    hf = _hf(path)
    llm = LLM(path, max_batch_tokens=64, num_kv_blocks=64)
    for ids in prompts:
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
    return llm


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_hf_over_prompt_and_decode_steps(tiny_family_model, name):
    """Prompts of 5, 17 and 40 tokens then 8 decode steps (inside the 64-token window)."""
    llm = _check_logits(tiny_family_model(name), _prompts())
    # the C decode layers compute Llama's block with its windows (Mistral, Phi-3: the
    # decode steps above ran through them, where a compiler is present), not the others
    fast = name in ("mistral", "phi3") and native.library() is not None
    assert (llm.engine.model.cpu_decode is not None) == fast


@pytest.fixture(scope="module")
def hf_reference(tiny_family_model):
    """name -> (path, prompts, HF's greedy continuation of each)."""
    made = {}

    def get(name: str):
        if name not in made:
            path, prompts = tiny_family_model(name), _prompts()
            hf = _hf(path)
            made[name] = path, prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
        return made[name]

    return get


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_greedy_matches_hf_at_every_chunk_size(hf_reference, name, chunk):
    """Prompts of 5, 17 and 40 tokens together: chunks of ``chunk`` tokens beside the
    decodes of the others (64: whole prompts)."""
    path, prompts, expected = hf_reference(name)
    llm = LLM(path, max_batch_tokens=chunk, num_kv_blocks=64)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    llm.engine.blocks.check_integrity()
    assert llm.engine.blocks.num_free_blocks == 64


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_preempted_requests_recompute_to_hf_greedy(hf_reference, name):
    """12 blocks of 4 tokens for three requests that need 6, 9 and 12: requests are
    preempted (their KV dropped) and recomputed, and still match HF."""
    path, prompts, expected = hf_reference(name)
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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "mistral", "gemma3", "phi3"])
def test_tensor_parallel_2_matches_hf(hf_reference, name):
    """Two ranks of two query heads and one KV head each: q/k/v biases and Phi-3's fused
    rows cut with their heads, q/k norms and Gemma's norms replicated."""
    path, prompts, expected = hf_reference(name)
    with LLM(path, max_batch_tokens=16, num_kv_blocks=64, tensor_parallel=2) as llm:
        layer = llm.engine.model.layers[0]
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.timeout(120)
def test_an_instance_serves_gemma3_with_its_bytes_per_token(hf_reference):
    """The co-located worker (the pools' base) on Gemma 3: ``ready()`` carries the KV
    bytes per token of its 4 layers, and the streamed tokens are HF's greedy ones."""
    import time

    from pdserve.instance.messages import Attempt
    from pdserve.instance.worker import EngineWorker

    path, prompts, expected = hf_reference("gemma3")
    worker = EngineWorker("colocated-0", path, {"num_kv_blocks": 32}, 1)
    try:
        # layers x K/V x heads x head_dim x float32
        assert worker.ready()["kv_cache_bytes_per_token"] == 4 * 2 * 2 * 16 * 4
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["mistral_w8", "gemma2_w8", "gemma3_w8"])
def test_logits_match_hf_past_the_sliding_window(tiny_family_model, name):
    """Window 8, prompts of 16 and 24 tokens then 8 decode steps: every sliding layer
    drops the oldest tokens as HF's mask does."""
    _check_logits(tiny_family_model(name), _prompts((16, 24)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_greedy_matches_hf_past_the_sliding_window(tiny_family_model, chunk):
    path = tiny_family_model("gemma2_w8")
    prompts = _prompts((16, 24))
    hf = _hf(path)
    llm = LLM(path, max_batch_tokens=chunk, num_kv_blocks=64)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.timeout(120)
def test_gemma2_attention_softcap_matches_hf(tiny_family_model):
    """attn_logit_softcapping 2: every layer's scores are capped before the softmax."""
    _check_logits(tiny_family_model("gemma2_softcap"), _prompts((5, 17)))


def test_family_config_reads_as_hf_builds_the_layers(tiny_family_model):
    """Gemma 2's windows on its sliding layers only, its scale from query_pre_attn_scalar,
    its caps; Gemma 3's local RoPE base on its sliding layers; Mistral's window on all."""
    read = lambda name: ModelConfig.from_hf(  # noqa: E731
        json.loads((Path(tiny_family_model(name)) / "config.json").read_text())
    )
    gemma2, gemma3, mistral = read("gemma2"), read("gemma3"), read("mistral")
    assert gemma2.layer_windows == (64, None, 64, None)
    assert (gemma2.attn_scale, gemma2.final_softcap, gemma2.attn_softcap) == (24**-0.5, 5.0, None)
    assert gemma3.rope_theta == 1e6 and gemma3.local_rope["rope_theta"] == 1e4
    assert mistral.layer_windows == (64, 64)
    assert (mistral.cache_window, gemma2.cache_window, gemma3.cache_window) == (64, None, None)
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3}
    old = dict(qwen2, sliding_window=4, use_sliding_window=True, max_window_layers=1)
    from pdserve.engine.families import family_of, layer_windows

    assert layer_windows(family_of(old), old) == (None, 4, 4)
    assert layer_windows(family_of(qwen2), dict(old, use_sliding_window=False)) == (None,) * 3


@pytest.mark.timeout(60)
def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tiny_family_model, tmp_path):
    folder = tmp_path / "unknown"
    shutil.copytree(tiny_family_model("qwen2"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "architectures": ["MixtralForCausalLM"]})
    )
    with pytest.raises(ValueError) as err:
        LLM(str(folder))
    assert "architectures='MixtralForCausalLM'" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    "patch,needle",
    [
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}}, "longrope"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "0.5"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_variants_the_engine_does_not_compute_are_refused_by_name(tiny_family_model, patch, needle):
    config = json.loads((Path(tiny_family_model("phi3")) / "config.json").read_text())
    config.pop("rope_parameters")
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf({**config, **patch})
