"""The prefill-sized float32 projection of ``amx_gemm.c``: ``x @ W.T`` on the CPU's AMX
tiles, from a weight's Q4 / Q8 panels (``engine/cpu_gemm.py``), with float32 accuracy
(each product exact as three bfloat16 ones). Present where the CPU has AMX, the compiler
knows it and Linux grants the tile state; ``amx_gemm()`` is None elsewhere, and
``F.linear`` or MKL's packed GEMM run instead."""

from __future__ import annotations

import ctypes
import threading

import torch

from pdserve.engine import native

_P, _I = ctypes.c_void_p, ctypes.c_int64


class AmxGemm:
    """The kernel's calls, bound from the built library (after ``amx_enable``)."""

    def __init__(self, lib: ctypes.CDLL):
        self.scratch_bytes = lib.amx_scratch_bytes
        self.scratch_bytes.argtypes, self.scratch_bytes.restype = [_I, _I, _I], _I
        self.gemm = lib.amx_gemm_blocks
        self.gemm.argtypes = [_P, _I, _P, ctypes.c_int, _P, _I, _I, _I, _I, _P, ctypes.c_int]
        self.gemm.restype = ctypes.c_bool
        self._local = threading.local()

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """This thread's scratch, grown to nbytes: ~6 bytes per element of x (21 MB for a
        2048-token pass's largest projection). A fresh one each call cost ~2% of a
        prefill pass in page faults; kept per thread, no two threads share it."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf

    def __call__(
        self, x: torch.Tensor, panels: torch.Tensor, format: int, out_features: int
    ) -> torch.Tensor:
        """x [M, K] (float32, unit stride along K) against a weight's Q4 / Q8 ``panels``
        (``format``) -> x @ W.T [M, out_features]."""
        m, k = x.shape
        threads = torch.get_num_threads()
        scratch = self._scratch(self.scratch_bytes(m, out_features, k))
        y = x.new_empty(m, out_features)
        ok = self.gemm(
            x.data_ptr(),
            x.stride(0),
            panels.data_ptr(),
            format,
            y.data_ptr(),
            out_features,
            m,
            out_features,
            k,
            scratch.data_ptr(),
            threads,
        )
        if not ok:
            raise ValueError(f"AMX GEMM takes Q4 / Q8 panels with K % 32 == 0, not {format}, {k}")
        return y


def _bind(lib: ctypes.CDLL) -> AmxGemm | None:
    lib.amx_enable.restype = ctypes.c_bool
    return AmxGemm(lib) if lib.amx_enable() else None


# the AMX kernel, or None where the ISA in use (engine/native.py), the compiler or the
# kernel do not allow it
amx_gemm = native.per_isa(_bind)
