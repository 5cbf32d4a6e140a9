"""The engine against HF transformers on the same weights: logits and greedy continuations."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoint import alias_path
from tests.engine_utils import hf_greedy, prompt_logits

TINY = ["gqa2", "mha", "gqa3", "mqa"]


def _prompts(vocab: int, lengths=(5, 17, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_tiny(tiny_model):
    """name -> (path, prompts, HF's prompt logits, HF's greedy continuations of 32)."""
    from transformers import AutoModelForCausalLM

    made = {}

    def get(name: str):
        if name not in made:
            path = tiny_model(name)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            prompts = _prompts(256)
            with torch.no_grad():
                logits = [hf(torch.tensor([ids])).logits[0] for ids in prompts]
            made[name] = (path, prompts, logits, [hf_greedy(hf, ids, 32) for ids in prompts])
        return made[name]

    return get


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_match_hf(isa, hf_tiny, name):
    """On each ISA the CPU has (tests/conftest.py isa)."""
    path, prompts, logits, greedy = hf_tiny(name)
    llm = LLM(path, max_batch_tokens=64, num_kv_blocks=64)
    for ids, expected in zip(prompts, logits, strict=True):
        got = prompt_logits(llm.engine, ids)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [out.token_ids for out in outs] == greedy
    llm.engine.blocks.check_integrity()
    assert llm.engine.blocks.num_free_blocks == 64


@pytest.fixture(scope="module")
def hf_embedded():
    """SmolLM2 through transformers' own GGUF loader: the prompts, their logits, and the
    greedy continuations (32 tokens) of the first and last."""
    from transformers import AutoModelForCausalLM

    gguf = alias_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = LLM("smollm2-135m", num_kv_blocks=16).tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea,",
    ]
    chats = [[{"role": "user", "content": "What is the capital of France?"}]]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts += [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in chats]
    with torch.no_grad():
        logits = [hf(torch.tensor([ids])).logits[0] for ids in prompts]
    # HF runs this GGUF through its dequantizing layers (~0.25 s a token): two prompts suffice
    greedy = [prompts[0], prompts[-1]]
    return prompts, logits, greedy, [hf_greedy(hf, ids, 32) for ids in greedy]


def test_embedded_model_matches_hf(isa, hf_embedded):
    """SmolLM2 from the GGUF: ours against transformers' own GGUF loader, on each ISA the
    CPU has (tests/conftest.py isa)."""
    prompts, logits, greedy, continuations = hf_embedded
    llm = LLM("smollm2-135m", num_kv_blocks=256)
    for ids, expected in zip(prompts, logits, strict=True):
        got = prompt_logits(llm.engine, ids)
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    outs = llm.generate(greedy, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [out.token_ids for out in outs] == continuations
    assert outs[-1].text.startswith("The capital of France is Paris.")


def test_bfloat16_matches_hf_bfloat16(tiny_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model("gqa3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = LLM(path, dtype="bfloat16", max_batch_tokens=64, num_kv_blocks=64)
    for ids in _prompts(256):
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].float()
        got = prompt_logits(llm.engine, ids)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=0.3, rtol=0.05)  # bf16 rounding
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
    out = llm.generate(_prompts(256)[0], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) == 8
