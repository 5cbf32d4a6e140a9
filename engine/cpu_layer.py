"""The decode step of every decoder layer in two C calls (``cpu_layer.c``) instead of a
dozen torch ops: the path of a decode-only batch in float32 on CPU.

A decode step at small batch streams every weight once and does little else; in plain
torch the rest is ~15 Python-level ops per layer, a quarter of a batch-1 step here. The
C layer runs the same kernels the torch path calls one by one (``cpu_gemm.c``,
``cpu_ops.c``, ``attention/cpu_decode.c``), so both paths compute the same function.
``LlamaModel`` takes this path when ``CpuDecodeLayers.begin`` returns a step, else the
per-op layers. A layer's ``window`` and ``softcap`` attributes (absent or None: full
attention, no capping) reach the C decode attention as the per-op layer passes them to
the attention backend.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pdserve.engine import native
from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.cpu_gemm import MAX_ROWS

_P = ctypes.c_void_p
_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Layer(ctypes.Structure):
    _fields_ = (
        [
            (name, _P)
            for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down", "k", "v")
        ]
        + [
            (name, ctypes.c_int64)
            for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size")
        ]
        + [(f"{name}_format", ctypes.c_int64) for name in _PROJECTIONS]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
        + [("window", ctypes.c_int64), ("softcap", ctypes.c_float)]
    )


class _Batch(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("positions", "slots", "cos", "sin", "tables", "lens")] + [
        ("num_seqs", ctypes.c_int64),
        ("table_stride", ctypes.c_int64),
        ("scratch", _P),
        ("threads", ctypes.c_int),
    ]


@dataclass
class DecodeStep:
    """One step's batch (its tensors kept alive while the C calls read them)."""

    batch: _Batch
    tensors: tuple


class CpuDecodeLayers:
    """The C decode path of a model's layers; ``build`` returns None where it cannot run
    (not float32 on CPU, head_dim not a multiple of 16, no compiler, or a family whose
    block the C layer does not compute: every one but Llama, engine/families.py)."""

    def __init__(self, lib: ctypes.CDLL, model):
        self.model = model
        self._attention = lib.decode_attention_f32
        self._mlp = lib.decode_mlp_f32
        self._stack = lib.decode_layers_f32
        self._stack.argtypes = [ctypes.POINTER(_Layer), ctypes.c_int64, ctypes.POINTER(_Batch)]
        self._stack.argtypes += [_P] * 3
        self._stack.restype = ctypes.c_int
        self._scratch_floats = lib.decode_scratch_floats
        self._scratch_floats.restype = ctypes.c_int64
        for fn in (self._attention, self._mlp):
            fn.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Batch)] + [_P] * 4
        self._scratch_floats.argtypes = [ctypes.POINTER(_Layer), ctypes.c_int64, ctypes.c_int]
        self._attention.restype = ctypes.c_int
        self._mlp.restype = None
        self.layers: list[_Layer] = []
        self.stack = None  # the layers as one C array (decode_layers_f32)
        self.scratch = torch.empty(0)

    @staticmethod
    def build(model) -> CpuDecodeLayers | None:
        if model.dtype != torch.float32 or model.embed.device.type != "cpu":
            return None
        if model.cfg.head_dim % 16 or not model.cfg.family.cpu_decode:
            return None
        lib = native.library()
        return None if lib is None else CpuDecodeLayers(lib, model)

    def begin(
        self, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
    ) -> DecodeStep | None:
        """The step's C batch when it is decode-only, small enough and both the backend
        and the ops run their C kernels; else None (the torch layers run)."""
        attn, ops = self.model.attn, self.model.ops
        if meta.num_prefills or meta.num_seqs > MAX_ROWS:
            return None
        if not (getattr(attn, "use_kernel", False) and getattr(ops, "use_kernel", False)):
            return None
        if attn.name != "torch" or len(self.model.layers[0].panels) < 4:
            return None
        if not self.layers or self.layers[0].k != kv_caches[0][0].data_ptr():
            self.layers = [self._layer(i, k, v) for i, (k, v) in enumerate(kv_caches)]
            self.stack = (_Layer * len(self.layers))(*self.layers)
        b = meta.num_seqs
        threads = torch.get_num_threads()
        need = self._scratch_floats(ctypes.byref(self.layers[0]), b, threads)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need)
        positions = positions.contiguous()
        tables, lens = meta.block_tables.contiguous(), meta.seq_lens.contiguous()
        cos, sin = self.model.cos.contiguous(), self.model.sin.contiguous()
        batch = _Batch(
            positions.data_ptr(),
            meta.slot_mapping.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            b,
            tables.stride(0),
            self.scratch.data_ptr(),
            threads,
        )
        return DecodeStep(batch, (positions, meta.slot_mapping, cos, sin, tables, lens))

    def forward_all(self, step: DecodeStep, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on h [B, hidden] in one C call (one rank only: no all-reduce between
        the halves) -> (h, residual) as ``forward`` over the layers in turn."""
        h, residual = h.clone(), torch.empty_like(h)
        tmp = h.new_empty(2, *h.shape)
        rc = self._stack(
            self.stack,
            len(self.layers),
            ctypes.byref(step.batch),
            h.data_ptr(),
            residual.data_ptr(),
            tmp.data_ptr(),
        )
        if rc != 0:
            raise MemoryError("decode_layers_f32: could not allocate its score buffers")
        return h, residual

    def forward(self, i: int, step: DecodeStep, h: torch.Tensor, residual, tp):
        """Layer ``i`` on hidden states h [B, hidden] -> (h, residual) as the torch layer."""
        layer, batch = ctypes.byref(self.layers[i]), ctypes.byref(step.batch)
        out, res = torch.empty_like(h), torch.empty_like(h)
        rc = self._attention(
            layer,
            batch,
            h.data_ptr(),
            None if residual is None else residual.data_ptr(),
            out.data_ptr(),
            res.data_ptr(),
        )
        if rc != 0:
            raise MemoryError("decode_attention_f32: could not allocate its score buffers")
        h = tp.all_reduce(out)
        out, residual = torch.empty_like(h), torch.empty_like(h)
        self._mlp(layer, batch, h.data_ptr(), res.data_ptr(), out.data_ptr(), residual.data_ptr())
        return tp.all_reduce(out), residual

    def _layer(self, i: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> _Layer:
        layer = self.model.layers[i]
        twins = [layer.panels[name] for name in _PROJECTIONS]
        qkv, o, gate_up, down = (twin.panels for twin in twins)
        weights = [layer.input_norm, qkv, o, layer.post_norm, gate_up, down]
        for w in (*weights, k_cache, v_cache):
            if not w.is_contiguous():
                raise ValueError(f"layer {i}: the C decode path needs contiguous tensors")
        return _Layer(
            *(w.data_ptr() for w in weights),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            self.model.cfg.hidden_size,
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
            layer.down.shape[1],
            k_cache.shape[1],
            *(twin.format for twin in twins),
            layer.eps,
            layer.scale,
            getattr(layer, "window", None) or 0,
            getattr(layer, "softcap", None) or 0.0,
        )
