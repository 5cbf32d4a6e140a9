"""The decoder of every family in engine/families.py (Llama, Qwen2/3, Mistral, Gemma 2/3,
Phi-3, and DeepSeek's MLA through engine/mla.py) over a paged KV cache: Llama's block
with each family's differences switched on by its ``Family`` record.

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

from pdserve.engine.amx_gemm import amx_gemm
from pdserve.engine.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_gemm import CpuGemm, PanelWeight, cpu_gemm
from pdserve.engine.cpu_layer import CpuDecodeLayers
from pdserve.engine.linear import linear, prepare
from pdserve.engine.mla import MLAAttention
from pdserve.engine.ops import Ops
from pdserve.engine.parallel import SINGLE, TensorParallel
from pdserve.engine.rope import rope_tables

_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class DecoderLayer(nn.Module):
    """Attention (GQA, or with ``cfg.mla`` the ``MLAAttention`` in ``self.mla``) and the
    gated MLP, each behind an RMS norm with a residual; the family (``cfg.family``) adds:

    qkv_bias [(Hq + 2 Hkv) * D]  this rank's heads' q/k/v biases (Qwen2)
    q_norm, k_norm [D]           per-head RMS norms before RoPE (Qwen3, Gemma 3)
    attn_out_norm, mlp_out_norm  [hidden] norms of the attention and MLP outputs before
                                 their residual adds (Gemma); ``post_norm`` is then
                                 the checkpoint's pre_feedforward_layernorm
    window, softcap              this layer's sliding window and score soft-cap
    local_rope                   the layer reads the local RoPE tables (Gemma 3's
                                 sliding layers)
    Norm weights of ``norm_plus_one`` families hold 1 + w (engine/weight_map.py)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, dtype: torch.dtype, index: int):
        super().__init__()
        i0, i1 = tp.shard(cfg.intermediate_size, "intermediate_size")
        inter, hidden, d = i1 - i0, cfg.hidden_size, cfg.head_dim
        family = self.family = cfg.family

        def param(*shape, when: bool = True):
            if not when:
                return None
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = param(hidden)
        self.post_norm = param(hidden)
        self.attn_out_norm = param(hidden, when=family.sandwich_norms)
        self.mlp_out_norm = param(hidden, when=family.sandwich_norms)
        self.gate_up = param(2 * inter, hidden)
        self.down = param(hidden, inter)
        self.eps = cfg.rms_eps
        self.window, self.softcap = cfg.window(index), cfg.attn_softcap
        self.local_rope = cfg.local_rope is not None and self.window is not None
        self.mla = None if cfg.mla is None else MLAAttention(cfg, tp, dtype)
        if self.mla is None:
            q0, q1 = tp.shard(cfg.num_heads, "num_heads")
            k0, k1 = tp.shard(cfg.num_kv_heads, "num_kv_heads")
            self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, d
            qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * d
            self.qkv = param(qkv_rows, hidden)
            self.qkv_bias = param(qkv_rows, when=family.qkv_bias)
            self.q_norm = param(d, when=family.qk_norm)
            self.k_norm = param(d, when=family.qk_norm)
            self.o = param(hidden, self.num_heads * d)
            self.scale = cfg.attn_scale or d**-0.5
        self.projections = ("gate_up", "down") if self.mla else _PROJECTIONS
        # the projections' twins by name (prepare_weights): in panels for the C kernel
        self.panels: dict[str, PanelWeight] = {}

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for the projection ``name`` (qkv, o, gate_up, down)."""
        return linear(x, getattr(self, name), self.panels.get(name))

    def attention(self, x, rope, cache, meta, attn, ops) -> torch.Tensor:
        """Normed x [T, hidden] -> this rank's partial sum of the attention output."""
        if self.mla is not None:
            return self.mla(x, rope, cache, meta, attn.name, ops)
        k_cache, v_cache = cache
        t, d = x.shape[0], self.head_dim
        qkv = self.project("qkv", x)
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        q, k, v = qkv.split(
            [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1
        )
        q, k = q.view(t, -1, d), k.view(t, -1, d)
        if self.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, d), self.q_norm, self.eps).view(t, -1, d)
            k = ops.rms_norm(k.reshape(-1, d), self.k_norm, self.eps).view(t, -1, d)
        q, k = ops.rotary(q, k, rope)
        o = attn.forward(
            q,
            k,
            v.view(t, -1, d),
            k_cache,
            v_cache,
            meta,
            self.scale,
            window=self.window,
            softcap=self.softcap,
        )
        return self.project("o", o.reshape(t, -1))

    def mlp(self, x, ops) -> torch.Tensor:
        """Normed x [T, hidden] -> this rank's partial sum of the MLP output."""
        twin = self.panels.get("gate_up")
        if self.family.activation == "silu" and twin is not None and twin.fuses_silu_mul(x):
            return self.project("down", twin.silu_mul(x))
        gate_up = self.project("gate_up", x)
        if self.family.activation == "silu":
            act = ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh").mul_(up)
        return self.project("down", act)

    def forward(self, h, residual, rope, cache, meta, attn, ops, tp):
        """``cache``: this layer's (k_cache, v_cache), or its latent cache for MLA."""
        if residual is None:
            residual = h
            x = ops.rms_norm(h, self.input_norm, self.eps)
        else:
            x, residual = ops.add_rms_norm(h, residual, self.input_norm, self.eps)
        h = tp.all_reduce(self.attention(x, rope, cache, meta, attn, ops))
        if self.attn_out_norm is not None:
            h = ops.rms_norm(h, self.attn_out_norm, self.eps)
        x, residual = ops.add_rms_norm(h, residual, self.post_norm, self.eps)
        h = tp.all_reduce(self.mlp(x, ops))
        if self.mlp_out_norm is not None:
            h = ops.rms_norm(h, self.mlp_out_norm, self.eps)
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
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, dtype, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype))
        self.lm_head = nn.Parameter(torch.empty(v1 - v0, cfg.hidden_size, dtype=dtype))
        self.lm_head_panels: PanelWeight | None = None  # prepare_weights
        self.kernels: str | None = None  # prepare_weights
        self.requires_grad_(False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        local = cfg.local_rope
        if local is not None:
            theta = float(local.get("rope_theta", cfg.rope_theta))
            cos, sin = rope_tables(cfg.head_dim, cfg.max_position, theta, local)
        self.register_buffer("cos_local", cos, persistent=False)
        self.register_buffer("sin_local", sin, persistent=False)
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
        if self.cfg.family.scaled_embedding:
            h = h * torch.tensor(self.cfg.hidden_size**0.5, dtype=h.dtype)
        residual = None
        step = (
            None if self.cpu_decode is None else self.cpu_decode.begin(positions, kv_caches, meta)
        )
        rope = local = None
        if step is None:
            rope = self.ops.rope(positions, self.cos, self.sin)
            if self.cfg.local_rope is not None:
                local = self.ops.rope(positions, self.cos_local, self.sin_local)
        layers = enumerate(zip(self.layers, kv_caches, strict=True))
        if step is not None and self.tp.size == 1 and on_layer is None:
            h, residual = self.cpu_decode.forward_all(step, h)
            layers = iter(())  # every layer ran in that call
        for i, (layer, cache) in layers:
            if step is not None:
                h, residual = self.cpu_decode.forward(i, step, h, residual, self.tp)
            else:
                r = local if layer.local_rope else rope
                h, residual = layer(h, residual, r, cache, meta, self.attn, self.ops, self.tp)
            if on_layer is not None:
                on_layer(i)
        h, _ = self.ops.add_rms_norm(h, residual, self.norm, self.cfg.rms_eps)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> float32 logits [S, vocab] (gathered across ranks)."""
        logits = linear(hidden, self.lm_head, panels=self.lm_head_panels).float()
        cap = self.cfg.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return self.tp.all_gather_last_dim(logits) if self.vocab_parallel else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...),
        keeping this rank's slices. Raises if any parameter is left unset."""
        from pdserve.engine.weight_map import assign_weights

        assign_weights(self, weights)

    def prepare_weights(self) -> None:
        """Store the projection weights as ``engine/linear.py`` reads them: contiguous
        [out, in] rows, and in float32 on CPU the twins that pack themselves on first
        use for the C kernel (whose panels of blocks also serve prefill on AMX). Called
        once after loading."""
        kernel, amx = cpu_gemm(), amx_gemm()
        # the ISA of the C kernels the projections run on, or None (plain torch)
        runs_c = kernel is not None and CpuGemm.supports(self.lm_head)
        self.kernels = kernel.isa if runs_c else None
        for owner in self._projection_owners():
            for name in owner.projections:
                weight = prepare(getattr(owner, name).data)
                setattr(owner, name, nn.Parameter(weight, False))
                if kernel is not None and CpuGemm.supports(weight):
                    owner.panels[name] = PanelWeight(kernel, weight, amx=amx)
        self.lm_head = nn.Parameter(prepare(self.lm_head.data), requires_grad=False)
        self.lm_head_panels = (
            PanelWeight(kernel, self.lm_head, amx=amx)
            if kernel is not None and CpuGemm.supports(self.lm_head)
            else None
        )

    def _projection_owners(self) -> list[nn.Module]:
        """The modules holding projections (``projections``, ``panels``):
        each layer, and its latent attention module when it has one."""
        return [o for layer in self.layers for o in (layer, layer.mla) if o is not None]

    def pack_panels(self) -> None:
        """Pack every projection's panels for the C kernel now: a served
        instance calls this before taking requests, or its first request would wait for
        the packing (~1 s on the embedded model)."""
        twins = [twin for owner in self._projection_owners() for twin in owner.panels.values()]
        for twin in twins + ([self.lm_head_panels] if self.lm_head_panels else []):
            twin.panels  # noqa: B018 (packs on first access)
