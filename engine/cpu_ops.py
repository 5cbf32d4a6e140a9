"""``TorchOps``' float32 CPU ops in C (``cpu_ops.c``), built on first use by
``engine/native.py``: one pass and one call each where plain torch takes four to six
ops (an RMS norm), four ops and a copy (rotary, per tensor) or a chunk and two ops
(SiLU and multiply); and the sampler's greedy argmax, plain or among the tokens a
grammar allows (one pass over the logits and a packed bitmask, where torch would unpack
the bits, copy the rows, fill and then search; bench.structured)."""

from __future__ import annotations

import ctypes

import torch

from pdserve.engine import native

_P, _I = ctypes.c_void_p, ctypes.c_int64


class CpuOps:
    def __init__(self, lib: ctypes.CDLL):
        self._norm = lib.add_rms_norm_f32
        self._norm.argtypes = [_P] * 5 + [_I] * 2 + [ctypes.c_float, ctypes.c_int]
        self._norm.restype = None
        self._rotary = lib.rotary_f32
        self._rotary.argtypes = [_P] + [_I] * 4 + [_P] * 3 + [ctypes.c_int]
        self._rotary.restype = None
        self._argmax = lib.argmax_rows_f32
        self._argmax.argtypes = [_P] + [_I] * 3 + [_P, ctypes.c_int]
        self._argmax.restype = None
        self._masked_argmax = lib.masked_argmax_f32
        self._masked_argmax.argtypes = [_P, _I, _P, _I, _P, _I, _I, _P, ctypes.c_int]
        self._masked_argmax.restype = None
        self._silu_mul = lib.silu_mul_f32
        self._silu_mul.argtypes = [_P, _I, _P, _I, _I, ctypes.c_int]
        self._silu_mul.restype = None

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.float32

    def add_rms_norm(self, x, residual, w, eps):
        """(rms_norm(x + residual) * w, x + residual); residual None: (rms_norm(x) * w, None)."""
        x, w = x.contiguous(), w.contiguous()
        out = torch.empty_like(x)
        total = None if residual is None else torch.empty_like(x)
        res_ptr = None if residual is None else residual.contiguous().data_ptr()
        rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
        self._norm(
            x.data_ptr(),
            res_ptr,
            w.data_ptr(),
            out.data_ptr(),
            None if total is None else total.data_ptr(),
            rows,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        return out, total

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x[:, :I]) * x[:, I:] for x [T, 2I] with contiguous rows."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, inter = x.numel() // x.shape[-1], x.shape[-1] // 2
        out = x.new_empty(*x.shape[:-1], inter)
        self._silu_mul(
            x.data_ptr(), x.stride(-2), out.data_ptr(), rows, inter, torch.get_num_threads()
        )
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, C] -> int64 [R], torch.argmax(x, -1)'s answer (first of equals, first NaN)."""
        if x.dim() != 2 or x.stride(1) != 1:
            x = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            x.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def masked_argmax(self, x: torch.Tensor, rows: list[int], bits: torch.Tensor) -> list[int]:
        """x [R, C] with contiguous rows, ``bits`` int32 [len(rows), ceil(C / 32)] (token c
        of row j allowed by bit c % 32 of bits[j, c // 32]) -> per j, the index of the
        largest allowed logit of row ``rows[j]`` (the first of equals; -1 if none allowed)."""
        assert x.dim() == 2 and x.stride(1) == 1 and bits.is_contiguous()
        assert bits.shape == (len(rows), (x.shape[1] + 31) // 32) and bits.dtype == torch.int32
        index = torch.tensor(rows, dtype=torch.int64)
        out = torch.empty(len(rows), dtype=torch.int64)
        self._masked_argmax(
            x.data_ptr(),
            x.stride(0),
            index.data_ptr(),
            len(rows),
            bits.data_ptr(),
            bits.shape[1],
            x.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out.tolist()

    def rotary_(self, x: torch.Tensor, positions, cos, sin) -> bool:
        """Rotate x [T, H, D] in place; False (nothing done) unless its heads are packed."""
        t, h, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d:
            return False
        self._rotary(
            x.data_ptr(),
            x.stride(0),
            t,
            h,
            d,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )
        return True


# the ops of the ISA in use (engine/native.py), or None when they cannot be built or loaded
cpu_ops = native.per_isa(CpuOps)
