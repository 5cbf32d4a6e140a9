"""Small random-weight Llama models written with HF transformers, for tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_SHAPES = {
    # GQA ratio 2, untied embeddings: the default small model of the suite
    "gqa2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # ratio 1 (multi-head), untied
    "mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    # ratio 3, tied embeddings
    "gqa3": dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
    # one KV head (MQA)
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    # 4 KV heads, for tensor-parallel degrees 1, 2 and 4
    "kv4": dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
}


def save_tiny_llama(folder: Path, seed: int = 0, **overrides) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    head_dim = 16
    heads = overrides.pop("num_attention_heads")
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=heads * head_dim,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        # larger than HF's default 0.02, so logits are spread and greedy picks are stable
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
