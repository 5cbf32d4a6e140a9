"""The model registry: which checkpoint ``architectures`` the engine serves, and how each
family's decoder block differs from Llama's, as data the one decoder (engine/model.py)
and the weight loader (engine/weight_map.py) read.

A family is a ``Family`` record; ``family_of(config_json)`` picks it by the checkpoint's
``architectures[0]`` and refuses any other name, listing the supported ones
(``check_family`` also refuses the variants the engine does not compute). A config
without ``architectures`` (hand-written, or from engine/gguf_convert.py) is Llama.
``family_fields(config_json)`` reads the per-checkpoint values the differences need
(each layer's sliding window, soft-capping, the attention scale, the local RoPE base)
as ``ModelConfig`` keyword arguments.

Sliding windows follow HF transformers: with window W the token at position p attends
to positions max(0, p - W + 1) .. p; a layer's window is None for full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.mla_config import MLA_ARCHITECTURES


@dataclass(frozen=True)
class Family:
    """How a family's block differs from Llama's (every flag False is Llama); ``name`` is
    how messages call it.

    qkv_bias         q/k/v projections carry a bias (sharded with their heads)
    qk_norm          RMS norm of every q and k head (one weight of head_dim, replicated
                     on tensor-parallel ranks) after the projection, before RoPE
    sandwich_norms   the attention and MLP outputs are RMS-normed before each residual
                     add (post_attention_layernorm, post_feedforward_layernorm); the MLP
                     input norm is pre_feedforward_layernorm
    norm_plus_one    every RMS norm multiplies by (1 + weight); the loader stores 1 + w
    scaled_embedding the embedding is multiplied by sqrt(hidden_size)
    activation       "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh GELU)
    fused_weights    the checkpoint holds qkv_proj and gate_up_proj (Phi-3)
    window_layers    "none", "all" (config ``sliding_window`` on every layer: Mistral,
                     Phi-3) or "typed" (``layer_types``, else the family's default
                     pattern: ``default_sliding``)
    default_sliding  the layer-type pattern when ``layer_types`` is absent: "qwen"
                     (``use_sliding_window`` from ``max_window_layers`` on), "alternate"
                     (even layers slide: Gemma 2) or "pattern" (``sliding_window_pattern``,
                     Gemma 3)
    latent           latent/tied attention (engine/mla_config.py)
    cpu_decode       the C decode layer (engine/cpu_layer.py) computes this block exactly
    """

    name: str
    architectures: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    norm_plus_one: bool = False
    scaled_embedding: bool = False
    activation: str = "silu"
    fused_weights: bool = False
    window_layers: str = "none"
    default_sliding: str = "qwen"
    latent: bool = False
    cpu_decode: bool = False


LLAMA = Family("Llama", ("LlamaForCausalLM",), cpu_decode=True)
_GEMMA = dict(
    sandwich_norms=True,
    norm_plus_one=True,
    scaled_embedding=True,
    activation="gelu_tanh",
    window_layers="typed",
)
FAMILIES = (
    LLAMA,
    Family("Qwen2", ("Qwen2ForCausalLM",), qkv_bias=True, window_layers="typed"),
    Family("Qwen3", ("Qwen3ForCausalLM",), qk_norm=True, window_layers="typed"),
    Family("Mistral", ("MistralForCausalLM",), window_layers="all", cpu_decode=True),
    Family("Gemma 2", ("Gemma2ForCausalLM",), default_sliding="alternate", **_GEMMA),
    Family("Gemma 3", ("Gemma3ForCausalLM",), qk_norm=True, default_sliding="pattern", **_GEMMA),
    Family("Phi-3", ("Phi3ForCausalLM",), fused_weights=True, window_layers="all", cpu_decode=True),
    Family("MLA", MLA_ARCHITECTURES, latent=True),
)
SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)
# RoPE frequency scalings engine/rope.py computes (``rope_type``, or ``type`` in older configs)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def family_of(cfg: dict) -> Family:
    """The family of a ``config.json`` dict by ``architectures[0]``; raises for others."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    for family in FAMILIES:
        if arch in family.architectures:
            return family
    raise ValueError(
        f"architectures={arch!r}: not a supported model; supported are "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (docs/models.md)"
    )


def rope_parameters(cfg: dict) -> tuple[dict | None, dict | None]:
    """(global, local) RoPE parameters of a ``config.json`` dict: ``rope_parameters``
    (transformers 5) or ``rope_scaling``; Gemma 3 nests them by layer type, and older
    Gemma 3 configs name the local base ``rope_local_base_freq``. local is None where
    every layer uses the global ones."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if rope and "full_attention" in rope:
        return rope["full_attention"], rope.get("sliding_attention")
    if cfg.get("rope_local_base_freq") is not None:
        return rope, {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    return rope, None


def layer_windows(family: Family, cfg: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as HF builds the layers."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if family.window_layers == "none" or window is None:
        return (None,) * n
    if family.window_layers == "all":
        return (window,) * n
    types = cfg.get("layer_types") or [_default_type(family, cfg, i) for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries: need num_hidden_layers={n}")
    allowed = ("full_attention", "sliding_attention")
    for t in types:
        if t not in allowed:
            raise ValueError(f"layer_types entry {t!r}: allowed are {', '.join(allowed)}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _default_type(family: Family, cfg: dict, i: int) -> str:
    if family.default_sliding == "alternate":
        sliding = (i + 1) % 2 == 1
    elif family.default_sliding == "pattern":
        sliding = (i + 1) % cfg.get("sliding_window_pattern", 6) != 0
    else:
        sliding = bool(cfg.get("use_sliding_window")) and i >= cfg.get("max_window_layers", 0)
    return "sliding_attention" if sliding else "full_attention"


def check_family(cfg: dict) -> Family:
    """The family of a ``config.json`` dict; raises ValueError, naming the key, for an
    unsupported architecture or a variant of a family the engine does not compute."""
    family = family_of(cfg)
    _refuse_unsupported(family, cfg)
    return family


def family_fields(family: Family, cfg: dict) -> dict:
    """The ``ModelConfig`` keyword arguments of a family's differences, from its
    ``config.json`` dict (``check_family`` has accepted it)."""
    _, local = rope_parameters(cfg)
    scalar = cfg.get("query_pre_attn_scalar")
    return dict(
        family=family,
        layer_windows=layer_windows(family, cfg),
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        attn_scale=None if scalar is None else float(scalar) ** -0.5,
        local_rope=local,
    )


def _refuse_unsupported(family: Family, cfg: dict) -> None:
    if family.latent:
        return
    for key in ("mlp_bias", "attention_bias"):
        if cfg.get(key) and not (key == "attention_bias" and family.qkv_bias):
            raise ValueError(
                f"{key}={cfg[key]!r}: biases are supported on q/k/v only (Qwen2); "
                f"{family.name} checkpoints with {key} true are not served"
            )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    allowed = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}
    if act is not None and act not in allowed[family.activation]:
        raise ValueError(
            f"hidden_act={act!r}: {family.name} is served with "
            f"{', '.join(allowed[family.activation])} only"
        )
    rope, local = rope_parameters(cfg)
    for scaling in (rope, local):
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind not in (None, *ROPE_TYPES):
            raise ValueError(
                f"rope_scaling.rope_type={kind!r}: supported are {', '.join(ROPE_TYPES)}"
            )
    partial = (rope or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ValueError(
            f"partial_rotary_factor={partial!r}: only RoPE over the whole head (1.0) is supported"
        )
