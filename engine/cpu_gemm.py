"""The float32 projection of ``cpu_gemm.c`` (``x @ W.T``) for any number of rows, with W
packed into the kernel's panels on first use (as Q4_1 / Q8_0 blocks where its floats
are exactly such blocks: a GGUF's); built on first use, for the ISA in use, by
``engine/native.py``. Where the CPU has AMX, panels of blocks serve batches above
``MAX_ROWS`` rows on its tiles (``engine/amx_gemm.py``).

Every row is the same chain of multiply-adds whatever the batch and the ISA
(``cpu_gemm.c``): a token's logits do not depend on what shares its step, nor on whether
its row was a prefill chunk or a decode, nor on AVX2 against AVX-512. AMX computes the
same products in another order (float32-exact, not bit-equal); it takes only batches of
more than ``MAX_ROWS`` rows, which decode steps stay below.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.engine import native
from pdserve.engine.amx_gemm import AmxGemm

_P, _I = ctypes.c_void_p, ctypes.c_int64
# the PANELS_* layouts of cpu_kernels.h, the block ones tried first
F32, Q4, Q8 = 0, 1, 2
# above this many rows, AMX (where the CPU has it and the panels hold blocks) takes the
# product: decode batches stay below it, so their results never depend on the batch
MAX_ROWS = 64
# the fused gate/up/SiLU takes the tiled path, which is slower than the direct one (at
# most 4 rows, cpu_gemm.c) below this many rows
FUSED_MIN_ROWS = 5


class CpuGemm:
    """The kernel's two calls, bound from the built library."""

    def __init__(self, lib: ctypes.CDLL):
        lib.gemm_panel_width.restype = _I
        lib.kernels_isa.restype = ctypes.c_char_p
        self.width = lib.gemm_panel_width()
        self.isa = lib.kernels_isa().decode()
        self.bytes = lib.gemm_panel_bytes
        self.bytes.argtypes, self.bytes.restype = [ctypes.c_int, _I], _I
        self.pack = lib.pack_panels_f32
        self.pack.argtypes = [_P, _I, _I, _I, _P]
        self.pack.restype = None
        self.pack_blocks = lib.pack_panels_blocks
        self.pack_blocks.argtypes = [_P, _I, _I, _I, ctypes.c_int, _P, ctypes.c_int]
        self.pack_blocks.restype = ctypes.c_bool
        self.gemm = lib.gemm_panel_f32
        self.gemm.argtypes = [_P, _I, _P, ctypes.c_int, _P, _I, _I, _I, _I, _P, ctypes.c_int]
        self.gemm.restype = None
        self.silu_mul = lib.gemm_silu_mul_f32
        self.silu_mul.argtypes = self.gemm.argtypes
        self.silu_mul.restype = None
        self.scratch_floats = lib.gemm_scratch_floats
        self.scratch_floats.argtypes, self.scratch_floats.restype = [_I, ctypes.c_int], _I

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and weight.dim() == 2
            and weight.stride(1) == 1
        )


class PanelWeight:
    """An [out, in] float32 weight for y = x @ W.T, packed into the kernel's panels on
    first use. They serve batches of any size; when they hold blocks and ``amx`` is
    given, those above ``MAX_ROWS`` rows run on the AMX tiles. The copy costs the
    weight's size again, or 0.19x of it as Q4 blocks (0.28x as Q8); finding the blocks
    of the embedded model takes ~1 s, once."""

    def __init__(
        self,
        kernel: CpuGemm,
        weight: torch.Tensor,
        formats: tuple[int, ...] = (Q4, Q8),
        amx: AmxGemm | None = None,
    ):
        """``formats``: the block layouts to try before the float32 one; ``amx``: the
        AMX kernel, for batches above ``MAX_ROWS`` rows when the panels hold blocks."""
        if not CpuGemm.supports(weight):
            raise ValueError(f"panels need a 2-D float32 CPU weight with unit stride, not {weight}")
        self.kernel, self.weight, self.formats, self.amx = kernel, weight, formats, amx
        self.out_features, self.in_features = weight.shape
        self._panels: torch.Tensor | None = None
        self._format = F32

    @property
    def panels(self) -> torch.Tensor:
        """The packed weight (``format`` says its layout), packed on first access."""
        if self._panels is None:
            self._format, self._panels = self._pack()
        return self._panels

    @property
    def format(self) -> int:
        """The layout of ``panels`` (F32, Q4 or Q8), packing them if not yet done."""
        self.panels  # noqa: B018 (packs on first access)
        return self._format

    def _pack(self) -> tuple[int, torch.Tensor]:
        n, k, w, kernel = self.out_features, self.in_features, self.weight, self.kernel
        count = -(-n // kernel.width)
        for fmt in self.formats:
            out = torch.empty(count * kernel.bytes(fmt, k), dtype=torch.uint8)
            args = (w.data_ptr(), w.stride(0), n, k, fmt, out.data_ptr())
            if kernel.pack_blocks(*args, torch.get_num_threads()):
                return fmt, out
        out = torch.empty(count, k, kernel.width)
        kernel.pack(w.data_ptr(), w.stride(0), n, k, out.data_ptr())
        return F32, out

    def supports(self, x: torch.Tensor) -> bool:
        """x is a float32 CPU matrix of ``in_features`` columns with unit stride."""
        return (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and x.dim() == 2
            and x.shape[0] > 0
            and x.shape[1] == self.in_features
            and x.stride(1) == 1
        )

    def _on_amx(self, m: int) -> bool:
        return m > MAX_ROWS and self.amx is not None and self.format != F32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] (``supports``) -> x @ W.T [M, out]."""
        if self._on_amx(x.shape[0]):
            return self.amx(x, self.panels, self.format, self.out_features)
        return self._run(self.kernel.gemm, x, self.out_features)

    def fuses_silu_mul(self, x: torch.Tensor) -> bool:
        """Whether ``silu_mul(x)`` runs fused: W is [gate; up] in whole panels each, and
        x has more rows than the direct path takes (and fewer than AMX would)."""
        half = self.out_features // 2
        return (
            self.supports(x)
            and self.out_features % 2 == 0
            and half % self.kernel.width == 0
            and x.shape[0] >= FUSED_MIN_ROWS
            and not self._on_amx(x.shape[0])
        )

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] (``fuses_silu_mul``) -> silu(x @ Wg.T) * (x @ Wu.T) [M, out / 2],
        bit for bit what the projection then the C pass of ``Ops.silu_and_mul`` give."""
        return self._run(self.kernel.silu_mul, x, self.out_features // 2)

    def _run(self, fn, x: torch.Tensor, width: int) -> torch.Tensor:
        """``fn`` (the kernel's gemm or silu_mul) on x into a new [M, width]."""
        m, threads = x.shape[0], torch.get_num_threads()
        # per call (~0.1 MB at 64 rows, ~0.25 MB from 256 on), so that no two threads share one
        scratch = torch.empty(self.kernel.scratch_floats(m, threads))
        y = x.new_empty(m, width)
        fn(
            x.data_ptr(),
            x.stride(0),
            self.panels.data_ptr(),
            self.format,
            y.data_ptr(),
            width,
            m,
            width,
            self.in_features,
            scratch.data_ptr(),
            threads,
        )
        return y


# the kernel of the ISA in use (engine/native.py), or None when it cannot be built or loaded
cpu_gemm = native.per_isa(CpuGemm)
