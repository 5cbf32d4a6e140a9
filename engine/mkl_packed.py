"""Prefill projections through MKL with each weight packed once, on first use.

``F.linear`` hands MKL the weight in its checkpoint layout, and MKL copies it into its
internal blocked layout on every call: ~9% of a 512-token prefill here, and more of a
shorter one, where each weight serves fewer rows. MKL's packed API
(``cblas_sgemm_pack`` once, ``cblas_sgemm_compute`` per call) keeps that copy. The
symbols come from the MKL inside torch's own CPU library; where they are missing (a
torch built without MKL), ``mkl_packer()`` is None and ``F.linear`` runs.

Each weight is packed on its first prefill-sized call. The buffer MKL asks for is a
few times the weight, but MKL writes about the weight's size into it, and an untouched
page of a fresh allocation costs no memory: the embedded model's packed layers add
~0.4 GB to a process that prefills. The products are F.linear's, summed over k in
another order for some shapes (a test compares the two).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151
_I, _P = ctypes.c_int, ctypes.c_void_p
# The batch MKL tunes the packed layout for (the layout serves any batch). Packed for
# 1 row it gained nothing here; for 512 rows a step's 120 projections took 93 / 364 /
# 1400 ms at 128 / 512 / 2048 rows, against F.linear's 130 / 428 / 1622 ms.
PACK_ROWS = 512


class MklPacker:
    """The three MKL calls, bound from a loaded library."""

    def __init__(self, lib: ctypes.CDLL):
        self.size = lib.cblas_sgemm_pack_get_size
        self.size.argtypes, self.size.restype = [_I] * 4, ctypes.c_size_t
        self.pack = lib.cblas_sgemm_pack
        self.pack.argtypes = [_I] * 6 + [ctypes.c_float, _P, _I, _P]
        self.pack.restype = None
        self.compute = lib.cblas_sgemm_compute
        self.compute.argtypes = [_I] * 6 + [_P, _I, _P, _I, ctypes.c_float, _P, _I]
        self.compute.restype = None

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and weight.dim() == 2
            and weight.is_contiguous()
            and max(weight.shape) < 2**31
        )


class PackedWeight:
    """An [out, in] float32 weight for y = x @ W.T, packed into MKL's layout on first
    use: an instance that never runs a prefill-sized batch (a decode pool's) never
    holds the packed copy."""

    def __init__(self, packer: MklPacker, weight: torch.Tensor):
        if not MklPacker.supports(weight):
            raise ValueError(f"MKL packing needs a contiguous 2-D float32 CPU weight, not {weight}")
        self.packer, self.weight = packer, weight
        self.out_features, self.in_features = weight.shape
        self.buffer: torch.Tensor | None = None

    def _pack(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        size = self.packer.size(_B_MATRIX, PACK_ROWS, n, k)
        buffer = torch.empty(size, dtype=torch.uint8)
        self.packer.pack(
            _ROW_MAJOR, _B_MATRIX, _TRANS, PACK_ROWS, n, k, 1.0, self.weight.data_ptr(), k,
            buffer.data_ptr(),
        )  # fmt: skip
        return buffer

    def supports(self, x: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and x.dim() == 2
            and x.shape[1] == self.in_features
            and x.stride(1) == 1
            and 0 < x.shape[0] < 2**31
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (unit stride along in) -> x @ W.T [T, out]."""
        if self.buffer is None:
            self.buffer = self._pack()
        m, n, k = x.shape[0], self.out_features, self.in_features
        y = x.new_empty(m, n)
        self.packer.compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, x.data_ptr(), x.stride(0),
            self.buffer.data_ptr(), k, 0.0, y.data_ptr(), n,
        )  # fmt: skip
        return y


@functools.cache
def mkl_packer() -> MklPacker | None:
    """The packing calls of torch's bundled MKL, or None without them."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return MklPacker(lib)
    except (OSError, AttributeError):
        return None
