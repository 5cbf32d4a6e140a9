"""Tiny random-weight checkpoints of every family of engine/families.py beside Llama,
written with HF transformers' own config and model classes (float32, hidden 64, 4 query
heads of 16 over 2 KV heads, vocab 256)."""

from __future__ import annotations

from pathlib import Path

import torch

# window 64: prompts of up to 40 tokens plus 16 decoded stay inside it (the window
# does not bite); the "_w8" variants slide over 8 tokens so that it does
_GEMMA_TYPES = ["sliding_attention", "full_attention"] * 2
FAMILY_SHAPES = {
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", dict(head_dim=16)),
    "mistral": ("Mistral", dict(sliding_window=64)),
    "mistral_w8": ("Mistral", dict(sliding_window=8)),
    # query_pre_attn_scalar 24, not head_dim 16: the scale is the config's
    "gemma2": ("Gemma2", dict(sliding_window=64, attn_logit_softcapping=None)),
    "gemma2_w8": ("Gemma2", dict(sliding_window=8, attn_logit_softcapping=None)),
    # scores capped at 2: the cap bites at every layer
    "gemma2_softcap": ("Gemma2", dict(sliding_window=64, attn_logit_softcapping=2.0)),
    "gemma3": ("Gemma3", dict(sliding_window=64)),
    "gemma3_w8": ("Gemma3", dict(sliding_window=8)),
    "phi3": ("Phi3", {}),
}
_GEMMA = dict(
    tie_word_embeddings=True,  # as Gemma ships: the LM head is the unscaled embedding
    head_dim=16,
    query_pre_attn_scalar=24,
    final_logit_softcapping=5.0,
    layer_types=_GEMMA_TYPES,
    num_hidden_layers=4,
)


def save_tiny_family(folder: Path, name: str, seed: int = 0) -> None:
    """Write the tiny checkpoint ``name`` of ``FAMILY_SHAPES`` into ``folder``: every norm
    weight and bias drawn at random (HF starts them at 1, 0 or 0, which would hide a
    missing bias or a norm read as w instead of 1 + w)."""
    import transformers

    prefix, overrides = FAMILY_SHAPES[name]
    config_class = getattr(
        transformers, "Gemma3TextConfig" if prefix == "Gemma3" else f"{prefix}Config"
    )
    model_class = getattr(transformers, f"{prefix}ForCausalLM")
    kwargs = dict(
        tie_word_embeddings=False,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if prefix.startswith("Gemma"):
        kwargs.update(_GEMMA)
    if prefix == "Gemma3":
        kwargs.update(
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            }
        )
    config = config_class(**{**kwargs, **overrides})
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5) if not prefix.startswith("Gemma") else p.uniform_(-0.5, 0.5)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
