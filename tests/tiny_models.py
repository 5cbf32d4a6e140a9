"""Small random-weight Llama and DeepSeek (MLA) models written with HF transformers, for tests."""

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


# DeepSeek-V3/V2 shapes (dense layers only: first_k_dense_replace = num_hidden_layers)
TINY_MLA_SHAPES = {
    # low-rank query, interleaved RoPE (DeepSeek-V3's layout); RoPE key width 16, so
    # decode runs the C latent kernel (engine/attention/cpu_latent.py: widths multiples
    # of 16); the other shapes' 8 take the batched torch path
    "v3": dict(q_lora_rank=32, qk_rope_head_dim=16),
    # plain q_proj
    "v3_q_proj": dict(q_lora_rank=None),
    # RoPE on the halves
    "v3_halves": dict(q_lora_rank=32, rope_interleave=False),
    # yarn: frequencies ramped, cos/sin and the softmax scale corrected by mscale
    "v3_yarn": dict(
        q_lora_rank=32,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=128,
            mscale=0.8,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),  # fmt: skip
    ),
    # DeepSeek-V2 (RoPE as complex pairs)
    "v2": dict(q_lora_rank=32, architecture="v2"),
}


def save_tiny_deepseek(
    folder: Path, seed: int = 0, architecture: str = "v3", qk_rope_head_dim: int = 8, **overrides
):
    """A 2-layer random DeepSeek-V3 (or ``architecture="v2"``) with MLA: hidden 64, 4 heads,
    kv_lora_rank 32, qk_nope 16, qk_rope 8, v_head_dim 16, float32."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    config_class, model_class = {
        "v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
        "v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
    }[architecture]
    layers = 2
    config = config_class(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=16,
        n_routed_experts=8,
        first_k_dense_replace=layers,
        max_position_embeddings=1024,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)


# A byte-level tokenizer that fits the tiny models' 256-token vocabulary: ids 0-2 are
# <unk>, <s> (bos 1) and </s> (eos 2), ids 3-255 the bytes 3-255 (bytes 0-2 map to <unk>).
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def save_byte_tokenizer(folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) into ``folder``."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from pdserve.engine.tokenizer import Tokenizer

    byte_char = _byte_chars()
    assert set(byte_char) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(3, 256):
        vocab[byte_char[b]] = b
    backend = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )
    Tokenizer(backend, 1, (2,), TINY_CHAT_TEMPLATE).save(Path(folder))


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the one ByteLevel uses), by byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def save_tiny_chat_llama(folder: Path, seed: int = 0, **overrides) -> None:
    """A tiny random Llama (as ``save_tiny_llama``) with the byte-level tokenizer."""
    save_tiny_llama(folder, seed=seed, **overrides)
    save_byte_tokenizer(folder)
