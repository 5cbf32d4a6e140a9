"""The small-batch float32 projection of ``cpu_gemm.c`` (``x @ w.T`` with ``w`` in its
[out, in] layout), built on first use by ``engine/native.py``."""

from __future__ import annotations

import ctypes
import functools

import torch

from engine import native

_P, _I = ctypes.c_void_p, ctypes.c_int64
# up to this many rows the C kernel beats MKL (a step's projections, cycling through the
# layers' weights: 32 rows 43.7 against 62.5 ms here, 64 rows 78.9 against 96.1; at 128
# rows 151 against 142); above it the product is compute-bound and MKL's GEMM on the
# packed weights (engine/mkl_packed.py) is the faster one
MAX_ROWS = 64


class CpuGemm:
    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.gemm_nt_f32
        self.fn.argtypes = [_P, _I, _P, _I, _P, _I, _I, _I, _I, ctypes.c_int]
        self.fn.restype = None

    @staticmethod
    def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
        return (
            x.device.type == w.device.type == "cpu"
            and x.dtype == w.dtype == torch.float32
            and x.dim() == 2
            and x.shape[0] <= MAX_ROWS
            and x.shape[1] == w.shape[1]
            and x.stride(1) == 1
            and w.stride(1) == 1
        )

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w[N, K].T -> [M, N]; rows of x and w contiguous (``supports``)."""
        (m, k), n = x.shape, w.shape[0]
        y = torch.empty(m, n, dtype=x.dtype)
        self.fn(
            x.data_ptr(),
            x.stride(0),
            w.data_ptr(),
            w.stride(0),
            y.data_ptr(),
            n,
            m,
            n,
            k,
            torch.get_num_threads(),
        )
        return y


@functools.cache
def cpu_gemm() -> CpuGemm | None:
    """The built kernel, or None when it cannot be built or loaded."""
    lib = native.library()
    return None if lib is None else CpuGemm(lib)
