"""Model shape and engine limits as dataclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.families import LLAMA, Family, check_family, family_fields, rope_parameters
from pdserve.engine.guessers import GUESSERS
from pdserve.engine.mla_config import MLAConfig

if TYPE_CHECKING:
    import torch

# the weights' and KV cache's dtypes, by the name torch gives them; torch is imported only
# where a dtype is made, so a process that checks configs (the supervisor, the launcher)
# does not load it
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder: a family of engine/families.py (``family``: Llama, Qwen2,
    Qwen3, Mistral, Gemma 2/3, Phi-3), or with ``mla`` set latent/tied attention
    (DeepSeek-V2/V3's MLA with dense layers, GLA, GTA: engine/mla_config.py). With
    ``mla``, ``head_dim`` is the RoPE width ``qk_rope_head_dim`` (as HF's DeepSeek config
    has it) and ``num_kv_heads`` the cached latent/tied heads (MLA: 1, replicated on every
    tensor-parallel rank).

    The family's per-checkpoint values:
      layer_windows  each layer's sliding window W (None: full attention); empty: all
                     None. Position p attends to max(0, p - W + 1) .. p (HF's mask)
      attn_softcap   attention scores become c * tanh(score / c) before the softmax
      final_softcap  the logits likewise
      attn_scale     the softmax scale (None: head_dim ** -0.5; Gemma's
                     query_pre_attn_scalar ** -0.5)
      local_rope     RoPE parameters of the sliding layers (Gemma 3's local base);
                     None: every layer uses rope_theta and rope_scaling
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mla: MLAConfig | None = None
    family: Family = LLAMA
    layer_windows: tuple[int | None, ...] = ()
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_scale: float | None = None
    local_rope: dict | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries: "
                f"need num_layers={self.num_layers}"
            )

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def cache_window(self) -> int | None:
        """The window no layer reads beyond: the largest layer window when every layer
        has one, None when any layer attends to the whole context (what a cache may
        drop: positions before p - cache_window + 1 for a token at p)."""
        windows = [self.window(i) for i in range(self.num_layers)]
        return None if None in windows else max(windows)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """From a HF ``config.json`` dict; its ``architectures`` name the family
        (engine/families.py), and an unsupported one is refused listing the others."""
        family = check_family(cfg)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers 5 writes rope_parameters (rope_theta inside), older ones rope_scaling
        rope, _ = rope_parameters(cfg)
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        mla = None
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if family.latent:
            mla = MLAConfig.from_hf(cfg, rope)
            head_dim = mla.qk_rope_head_dim
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=mla.latent_heads if mla else cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=rope,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            mla=mla,
            **family_fields(family, cfg),
        )


MAX_SPECULATIVE = 16  # speculative_tokens at most


@dataclass
class EngineConfig:
    """Limits of one engine instance."""

    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_batch_tokens: int = 512
    max_batch_size: int = 64
    # prompt tokens a step may carry beside running decodes (None: what max_batch_tokens
    # leaves); bounds how much a prompt stretches the decodes' step (engine/scheduler.py)
    mixed_prefill_tokens: int | None = None
    attention_backend: str | None = None
    device: str = "cpu"
    seed: int = 0
    # reuse the KV of full blocks whose token prefix an earlier request computed
    # (engine/block_manager.py); the output is the same with it off
    enable_prefix_caching: bool = True
    # guessed tokens a decode step verifies per request (engine/speculative.py); 0: off
    speculative_tokens: int = 0
    # where the guesses come from (engine/guessers.py): ngram or suffix
    speculative_method: str = "ngram"

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: allowed values are {', '.join(DTYPES)}")
        for key in ("block_size", "num_kv_blocks", "max_batch_tokens", "max_batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r}: must be a positive integer")
        cap = self.mixed_prefill_tokens
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ValueError(f"mixed_prefill_tokens={cap!r}: must be None or a positive integer")
        k = self.speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE:
            raise ValueError(
                f"speculative_tokens={k!r}: must be an integer in [0, {MAX_SPECULATIVE}] (0: off)"
            )
        if self.speculative_method not in GUESSERS:
            raise ValueError(
                f"speculative_method={self.speculative_method!r}: allowed values are "
                f"{', '.join(GUESSERS)}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching={self.enable_prefix_caching!r}: must be true or false"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)
