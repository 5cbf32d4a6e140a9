"""The limits a benchmark of the engine checks its figures against, measured in the same
run on the ISA in use: no prefill pass beats the FMA peak over its multiply-adds, and no
decode step beats reading its packed weights and KV at the read bandwidth nor its
multiply-adds at that peak.

Work of the embedded model (and any Llama-shaped one), counted from the model:
  prefill of n tokens: 2 P + 4 L Hq D (n + 1) / 2 FLOP a token (P: the layers'
    projection weights; the attention of a token over (n + 1) / 2 keys on average,
    scores and values), plus the LM head once;
  decode step of b sequences at context c: reads the packed panels (the GGUF's Q4 / Q8
    blocks where the weights are such) and b c 2 L Hkv D float32 of KV, and does
    b (2 (P + V) + 4 L Hq D c) FLOP (V: the LM head).
The peak is ``bench/machine_limits.c``'s, built for the ISA like the kernels; where the
CPU has AMX, prefill's ceiling is also a third of the bfloat16 matmul peak (each float32
product as three bfloat16 ones, engine/amx_gemm.c), if that is higher.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine import native
from pdserve.engine.amx_gemm import amx_gemm
from pdserve.planner.floors import copy_bandwidth, matmul_peak

# a figure this far past its limit is refused; below it, the limit's own measurement
# (best of several, on a shared machine) may have come out a little low
MARGIN = 1.05
_SOURCE = Path(__file__).with_name("machine_limits.c")


class Impossible(SystemExit):
    """A figure past what the machine can do: the measurement is broken."""


def cpu_summary() -> str:
    """The CPU's model name and the vector extensions that matter here."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line for line in f if line.startswith("model name")).split(":")[1]
    except (OSError, StopIteration):
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    have = [flag for flag in wanted if flag in native.cpu_flags()]
    return f"CPU: {name.strip()} ({', '.join(have) or 'none of ' + ', '.join(wanted)})"


def _machine(isa: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(native.build(isa, sources=(_SOURCE,))))
    lib.fma_peak_flops.restype = lib.read_bandwidth.restype = ctypes.c_double
    lib.fma_peak_flops.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.read_bandwidth.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return lib


def fma_peak(isa: str, threads: int) -> float:
    """float32 FLOP/s of independent multiply-adds in ``isa``'s vectors on ``threads``."""
    return _machine(isa).fma_peak_flops(threads, 20_000_000, 5)


def read_bandwidth(isa: str, threads: int, nbytes: int = 1 << 30) -> float:
    """Bytes/s of one pass reading a buffer of ``nbytes`` (far past the caches)."""
    buf = torch.ones(nbytes // 4)
    return _machine(isa).read_bandwidth(buf.data_ptr(), buf.numel(), threads, 5)


@dataclass
class Limits:
    isa: str
    peak: float  # FLOP/s
    read_bw: float  # bytes/s
    copy_bw: float  # bytes/s, read + write counted (informative)
    mkl_peak: float  # FLOP/s of torch's float32 matmul (HF's GEMMs; informative)
    layer_params: int  # P
    head_params: int  # V
    attention: int  # 4 L Hq D: FLOP a token per key
    kv_bytes: int  # 2 L Hkv D 4: bytes of KV a token
    panel_bytes: int  # the packed weights a decode step reads

    @classmethod
    def measure(cls, model, isa: str, threads: int) -> Limits:
        cfg = model.cfg
        owners = model._projection_owners()
        twins = [t for owner in owners for t in owner.panels.values()]
        twins += [model.lm_head_panels] if model.lm_head_panels is not None else []
        layer_params = sum(
            getattr(owner, name).numel() for owner in owners for name in owner.projections
        )
        peak = fma_peak(isa, threads)
        if amx_gemm() is not None:
            peak = max(peak, matmul_peak(dtype=torch.bfloat16, repeats=20) / 3)
        return cls(
            isa=isa,
            peak=peak,
            read_bw=read_bandwidth(isa, threads),
            copy_bw=copy_bandwidth(),
            mkl_peak=matmul_peak(),
            layer_params=layer_params,
            head_params=model.lm_head.numel(),
            attention=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
            kv_bytes=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4,
            panel_bytes=sum(t.panels.nbytes for t in twins),
        )

    @property
    def q4_floor_s(self) -> float:
        """A decode step's floor from its packed weights alone (batch 1, short context)."""
        return self.panel_bytes / self.read_bw

    def prefill_ceiling(self, n: int) -> float:
        """Tokens/s no prefill pass of n tokens can beat."""
        flops = n * (2 * self.layer_params + self.attention * (n + 1) / 2)
        return n * self.peak / (flops + 2 * self.head_params)

    def decode_floor_s(self, batch: int, context: int) -> float:
        """Seconds no decode step of ``batch`` sequences at ``context`` can beat."""
        read = (self.panel_bytes + batch * context * self.kv_bytes) / self.read_bw
        flops = batch * (2 * (self.layer_params + self.head_params) + self.attention * context)
        return max(read, flops / self.peak)

    def check(self, name: str, figures: list[tuple[str, float]], limit: float) -> None:
        """Stops the bench (``Impossible``) if a figure (tokens/s) is past ``limit``."""
        for who, value in figures:
            if not value > 0 or value > MARGIN * limit:
                raise Impossible(
                    f"refusing to report {name}: {who} measured {value:.0f} tok/s, past the "
                    f"{limit:.0f} tok/s this machine allows ({self.describe()}): "
                    "the measurement is broken (a cache hit counted as work?)"
                )

    def describe(self) -> str:
        return (
            f"limits ({self.isa}): FMA peak {self.peak / 1e9:.0f} GFLOP/s (torch matmul "
            f"{self.mkl_peak / 1e9:.0f}), read bandwidth {self.read_bw / 1e9:.1f} GB/s (copy "
            f"{self.copy_bw / 1e9:.1f}); decode reads {self.panel_bytes / 1e6:.0f} MB of packed "
            f"weights: Q4 floor {self.q4_floor_s * 1e3:.2f} ms a step"
        )
