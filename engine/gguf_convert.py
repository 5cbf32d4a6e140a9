"""Convert a llama-architecture GGUF file into a HF folder (config.json,
model.safetensors in float32, tokenizer files), cached on disk so that later
loads skip the metadata parsing and dequantization. Finding the cached folder is light
(the router resolves the model for its tokenizer): torch and safetensors load only to
convert."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdserve.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

_DIRECT = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


# bytes read from each end of a GGUF for its cache key: the header and metadata, the
# last tensors
_KEY_BYTES = 1 << 20


def cache_key(gguf_path: Path) -> str:
    """The converted folder's key: the file's size and the bytes at both ends, and this
    converter's source. The same model installed in several virtual environments (each
    with its own path and mtime) shares one folder; a changed file or converter gets a
    new one."""
    h = hashlib.sha1(Path(__file__).read_bytes())
    size = gguf_path.stat().st_size
    h.update(str(size).encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(_KEY_BYTES))
        f.seek(max(size - _KEY_BYTES, 0))
        h.update(f.read(_KEY_BYTES))
    return h.hexdigest()[:12]


def converted_folder(gguf_path: Path) -> Path:
    """The HF folder for ``gguf_path``, converting it on first use."""
    target = cache_dir() / f"{gguf_path.stem}-{cache_key(gguf_path)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _convert(gguf_path, tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved rotary row order for q/k projections."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    fields = _fields(reader)
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"model={str(gguf_path)!r}: GGUF architecture {arch!r}, expected 'llama'")
    a = f"{arch}."
    heads = int(fields[a + "attention.head_count"])
    kv_heads = int(fields.get(a + "attention.head_count_kv", heads))
    hidden = int(fields[a + "embedding_length"])
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": int(fields[a + "feed_forward_length"]),
        "num_hidden_layers": int(fields[a + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(fields.get(a + "attention.key_length", hidden // heads)),
        "max_position_embeddings": int(fields.get(a + "context_length", 2048)),
        "rope_theta": float(fields.get(a + "rope.freq_base", 10000.0)),
        "rms_norm_eps": float(fields.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if fields.get(a + "rope.scaling.type") == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(fields[a + "rope.scaling.factor"]),
        }
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        shape = [int(x) for x in reversed(t.shape)]
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(data)
        if name.endswith("q_proj.weight"):
            w = unpermute_rotary(w, heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rotary(w, kv_heads)
        tensors[name] = w.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    Tokenizer.from_gguf_fields(fields).save(out)
    (out / "config.json").write_text(json.dumps(config, indent=1))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _DIRECT:
        return _DIRECT[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None
