"""GGUF loading of every tensor type we promise (F32, F16, Q8_0, Q4_0, Q4_1), with
llama.cpp's rotary row order, against the same weights quantized and dequantized by
the gguf package."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoint import load_checkpoint

HEADS, KV_HEADS, HIDDEN, INTER, LAYERS, VOCAB = 4, 2, 64, 96, 2, 256


def _permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF row order -> llama.cpp's (what convert_hf_to_gguf.py writes)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, qtypes) -> dict[str, np.ndarray]:
    """A tiny llama GGUF; returns the HF-named float32 weights it holds after quantization."""
    import gguf
    from gguf.quants import dequantize, quantize
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    w.add_token_list([*alphabet[: VOCAB - 1], "Ġt"])  # the last byte gives way to a merge
    w.add_token_merges(["Ġ t"])
    w.add_token_types([1] * VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    d = HIDDEN // HEADS
    shapes = {"token_embd.weight": ("model.embed_tokens.weight", (VOCAB, HIDDEN))}
    shapes["output.weight"] = ("lm_head.weight", (VOCAB, HIDDEN))
    shapes["output_norm.weight"] = ("model.norm.weight", (HIDDEN,))
    for i in range(LAYERS):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        shapes |= {
            p + "attn_norm.weight": (h + "input_layernorm.weight", (HIDDEN,)),
            p + "ffn_norm.weight": (h + "post_attention_layernorm.weight", (HIDDEN,)),
            p + "attn_q.weight": (h + "self_attn.q_proj.weight", (HEADS * d, HIDDEN)),
            p + "attn_k.weight": (h + "self_attn.k_proj.weight", (KV_HEADS * d, HIDDEN)),
            p + "attn_v.weight": (h + "self_attn.v_proj.weight", (KV_HEADS * d, HIDDEN)),
            p + "attn_output.weight": (h + "self_attn.o_proj.weight", (HIDDEN, HEADS * d)),
            p + "ffn_gate.weight": (h + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            p + "ffn_up.weight": (h + "mlp.up_proj.weight", (INTER, HIDDEN)),
            p + "ffn_down.weight": (h + "mlp.down_proj.weight", (HIDDEN, INTER)),
        }
    expected = {}
    for n, (name, (gname, shape)) in enumerate(shapes.items()):
        hf = rng.normal(0, 0.15, shape).astype(np.float32)
        if len(shape) == 1:
            hf = 1 + 0.1 * hf
        stored = hf
        if name.endswith("attn_q.weight"):
            stored = _permute_rotary(hf, HEADS)
        elif name.endswith("attn_k.weight"):
            stored = _permute_rotary(hf, KV_HEADS)
        qtype = gguf.GGMLQuantizationType.F32 if len(shape) == 1 else qtypes[n % len(qtypes)]
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, stored)
            expected[gname] = hf
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, stored.astype(np.float16))
            expected[gname] = hf.astype(np.float16).astype(np.float32)
        else:
            q = quantize(stored, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
            back = dequantize(quantize(hf, qtype), qtype).reshape(shape)
            expected[gname] = back.astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("qtypes", [("F16",), ("Q8_0",), ("Q4_0",), ("Q4_1",), ("F16", "Q4_0")])
def test_gguf_tensor_types_and_rotary_order(tmp_path, monkeypatch, qtypes):
    import gguf

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    expected = _write_gguf(path, [gguf.GGMLQuantizationType[q] for q in qtypes])
    ckpt = load_checkpoint(str(path))
    assert ckpt.config.num_kv_heads == KV_HEADS and not ckpt.config.tie_embeddings
    got = dict(ckpt.weights(torch.float32))
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert torch.equal(got[name], torch.from_numpy(want)), name
    out = LLM(str(path), num_kv_blocks=32).generate([5, 6, 7], SamplingParams(max_tokens=4))
    assert len(out[0].token_ids) == 4


def test_copies_of_a_gguf_share_one_converted_folder(tmp_path, monkeypatch):
    """The same file under another path and mtime (another virtual environment's copy of
    the model wheel) reuses the folder; a file that differs gets its own."""
    import gguf

    from pdserve.engine.gguf_convert import converted_folder

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first = tmp_path / "a" / "tiny.gguf"
    first.parent.mkdir()
    _write_gguf(first, [gguf.GGMLQuantizationType.Q8_0])
    folder = converted_folder(first)
    copy = tmp_path / "b" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copyfile(first, copy)
    os.utime(copy, ns=(1, 1))
    assert converted_folder(copy) == folder
    other = tmp_path / "c" / "tiny.gguf"
    other.parent.mkdir()
    _write_gguf(other, [gguf.GGMLQuantizationType.F16])
    assert converted_folder(other) != folder
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_merge_of_unknown_tokens_is_a_clear_error():
    from pdserve.engine.tokenizer import Tokenizer

    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b"],
        "tokenizer.ggml.merges": ["a b"],
    }
    with pytest.raises(ValueError, match="tokenizer.ggml.merges: 'a' \\+ 'b'"):
        Tokenizer.from_gguf_fields(fields)
