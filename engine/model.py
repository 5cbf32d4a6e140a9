"""Llama-family and DeepSeek (MLA, engine/mla.py) decoders over a paged KV cache.

Every layer holds its tensor-parallel shard only (local shapes); ``load_weights``
slices full checkpoint tensors as they arrive. QKV and gate/up are fused
column-parallel projections, O and down are row-parallel with one all-reduce each.
The LM head is vocab-parallel (rows sliced, logits gathered: each rank reads 1/N of
the largest matrix per step), or replicated when the vocabulary does not divide by
the degree. The embedding is replicated: a lookup reads only the batch's rows, so
splitting it would save memory but cost an all-reduce per step for nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.amx_gemm import amx_gemm
from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.cpu_gemm import CpuGemm, PanelWeight, cpu_gemm
from engine.cpu_layer import CpuDecodeLayers
from engine.linear import linear, prepare
from engine.mkl_packed import MklPacker, PackedWeight, mkl_packer
from engine.mla import MLAAttention
from engine.ops import Ops
from engine.parallel import SINGLE, TensorParallel
from engine.rope import rope_tables

_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class DecoderLayer(nn.Module):
    """Attention (Llama's GQA, or with ``cfg.mla`` the ``MLAAttention`` in ``self.mla``)
    and the SiLU-gated MLP, each behind an RMS norm with a residual."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        i0, i1 = tp.shard(cfg.intermediate_size, "intermediate_size")
        inter, hidden, d = i1 - i0, cfg.hidden_size, cfg.head_dim

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = param(hidden)
        self.post_norm = param(hidden)
        self.gate_up = param(2 * inter, hidden)
        self.down = param(hidden, inter)
        self.eps = cfg.rms_eps
        self.mla = None if cfg.mla is None else MLAAttention(cfg, tp, dtype)
        if self.mla is None:
            q0, q1 = tp.shard(cfg.num_heads, "num_heads")
            k0, k1 = tp.shard(cfg.num_kv_heads, "num_kv_heads")
            self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, d
            self.qkv = param((self.num_heads + 2 * self.num_kv_heads) * d, hidden)
            self.o = param(hidden, self.num_heads * d)
            self.scale = d**-0.5
        self.projections = ("gate_up", "down") if self.mla else _PROJECTIONS
        # the projections' twins by name (prepare_weights): packed for MKL's prefill
        # GEMM, and in panels for the small-batch C kernel
        self.packed: dict[str, PackedWeight] = {}
        self.panels: dict[str, PanelWeight] = {}

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for the projection ``name`` (qkv, o, gate_up, down)."""
        return linear(x, getattr(self, name), self.packed.get(name), self.panels.get(name))

    def attention(self, x, rope, cache, meta, attn, ops) -> torch.Tensor:
        """Normed x [T, hidden] -> this rank's partial sum of the attention output."""
        if self.mla is not None:
            return self.mla(x, rope, cache, meta, attn.name, ops)
        k_cache, v_cache = cache
        t, d = x.shape[0], self.head_dim
        q, k, v = self.project("qkv", x).split(
            [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1
        )
        q, k = ops.rotary(q.view(t, -1, d), k.view(t, -1, d), rope)
        o = attn.forward(q, k, v.view(t, -1, d), k_cache, v_cache, meta, self.scale)
        return self.project("o", o.reshape(t, -1))

    def forward(self, h, residual, rope, cache, meta, attn, ops, tp):
        """``cache``: this layer's (k_cache, v_cache), or its latent cache for MLA."""
        if residual is None:
            residual = h
            x = ops.rms_norm(h, self.input_norm, self.eps)
        else:
            x, residual = ops.add_rms_norm(h, residual, self.input_norm, self.eps)
        h = tp.all_reduce(self.attention(x, rope, cache, meta, attn, ops))
        x, residual = ops.add_rms_norm(h, residual, self.post_norm, self.eps)
        act = ops.silu_and_mul(self.project("gate_up", x))
        h = tp.all_reduce(self.project("down", act))
        return h, residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        attn: AttentionBackend,
        ops: Ops,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.cfg, self.attn, self.ops, self.tp, self.dtype = cfg, attn, ops, tp, dtype
        # The LM head is vocab-parallel (rows sliced, logits gathered) when the vocabulary
        # divides evenly, else replicated; see the module docstring.
        self.vocab_parallel = cfg.vocab_size % tp.size == 0
        v0, v1 = (
            tp.shard(cfg.vocab_size, "vocab_size") if self.vocab_parallel else (0, cfg.vocab_size)
        )
        self.vocab_range = (v0, v1)
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype))
        self.lm_head = nn.Parameter(torch.empty(v1 - v0, cfg.hidden_size, dtype=dtype))
        self.lm_head_panels: PanelWeight | None = None  # prepare_weights
        self.requires_grad_(False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # decode-only steps in float32 on CPU run each layer as two C calls
        self.cpu_decode = CpuDecodeLayers.build(self)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final normed hidden states [T, hidden].

        ``on_layer(i)`` runs once layer ``i`` has written its KV into the cache (the
        prefill pool sends that layer's KV from there while later layers compute)."""
        h = F.embedding(input_ids, self.embed)
        residual = None
        step = (
            None if self.cpu_decode is None else self.cpu_decode.begin(positions, kv_caches, meta)
        )
        rope = None if step is not None else self.ops.rope(positions, self.cos, self.sin)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if step is not None:
                h, residual = self.cpu_decode.forward(i, step, h, residual, self.tp)
            else:
                h, residual = layer(h, residual, rope, cache, meta, self.attn, self.ops, self.tp)
            if on_layer is not None:
                on_layer(i)
        h, _ = self.ops.add_rms_norm(h, residual, self.norm, self.cfg.rms_eps)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> float32 logits [S, vocab] (gathered across ranks)."""
        logits = linear(hidden, self.lm_head, panels=self.lm_head_panels).float()
        return self.tp.all_gather_last_dim(logits) if self.vocab_parallel else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...),
        keeping this rank's slices. Raises if any parameter is left unset."""
        from engine.weight_map import assign_weights

        assign_weights(self, weights)

    def prepare_weights(self) -> None:
        """Store the projection weights as ``engine/linear.py`` reads them: contiguous
        [out, in] rows, and in float32 on CPU the twins that pack themselves on first
        use, for MKL's prefill GEMM and for the small-batch C kernel (whose panels of
        blocks also serve prefill on AMX). Called once after loading."""
        packer, kernel, amx = mkl_packer(), cpu_gemm(), amx_gemm()
        for owner in self._projection_owners():
            for name in owner.projections:
                weight = prepare(getattr(owner, name).data)
                setattr(owner, name, nn.Parameter(weight, False))
                if packer is not None and MklPacker.supports(weight):
                    owner.packed[name] = PackedWeight(packer, weight)
                if kernel is not None and CpuGemm.supports(weight):
                    owner.panels[name] = PanelWeight(kernel, weight, amx=amx)
        self.lm_head = nn.Parameter(prepare(self.lm_head.data), requires_grad=False)
        self.lm_head_panels = (
            PanelWeight(kernel, self.lm_head, amx=amx)
            if kernel is not None and CpuGemm.supports(self.lm_head)
            else None
        )

    def _projection_owners(self) -> list[nn.Module]:
        """The modules holding projections (``projections``, ``packed``, ``panels``):
        each layer, and its latent attention module when it has one."""
        return [o for layer in self.layers for o in (layer, layer.mla) if o is not None]

    def pack_panels(self) -> None:
        """Pack every projection's panels for the small-batch kernel now: a served
        instance calls this before taking requests, or its first request would wait for
        the packing (~1 s on the embedded model)."""
        twins = [twin for owner in self._projection_owners() for twin in owner.panels.values()]
        for twin in twins + ([self.lm_head_panels] if self.lm_head_panels else []):
            twin.panels  # noqa: B018 (packs on first access)
