"""A device as the roofline sees it: peak compute, memory bandwidth and size, and the
links that carry all-reduces (inside an instance) and KV transfers (between them)."""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # FLOP/s at the served dtype (dense)
    mem_bandwidth: float  # bytes/s
    mem_bytes: float
    tp_bandwidth: float  # bytes/s per device for tensor-parallel collectives
    kv_bandwidth: float  # bytes/s from a prefill to a decode instance
    tp_latency_s: float = 10e-6  # per all-reduce
    kv_latency_s: float = 100e-6  # per transfer
    compute_eff: float = 0.6  # achievable share of peak_flops (MFU)
    mem_eff: float = 0.8  # achievable share of mem_bandwidth
    mem_util: float = 0.9  # share of memory weights + KV cache may use
    gpu: bool = True


PRESETS: dict[str, Hardware] = {
    # bf16 dense peaks; NVLink per-direction bandwidth; KV over NVLink (same node)
    "a100": Hardware("A100-80GB", 312e12, 2.039e12, 80 * GB, 300 * GB, 300 * GB),
    "h100": Hardware("H100-80GB", 989e12, 3.35e12, 80 * GB, 450 * GB, 450 * GB),
    "h200": Hardware("H200", 989e12, 4.8e12, 141 * GB, 450 * GB, 450 * GB),
}
ALIASES = {"a100-80gb": "a100", "h100-80gb": "h100", "h200-141gb": "h200"}


def get_hardware(name: str) -> Hardware:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ValueError(f"hardware {name!r}: allowed values are {', '.join(PRESETS)}")
    return PRESETS[key]


def this_cpu(threads: int = 1, mem_bytes: float = 2 * 2**30) -> Hardware:
    """This machine's cores as one device each, measured now (``planner.floors``): the
    matmul peak and copy bandwidth with ``threads`` torch threads. Collectives and KV
    go through memory (gloo on loopback), at a fraction of the copy bandwidth. Each
    device gets ``mem_bytes`` (2 GiB) for weights and KV cache: a local config's share."""
    import torch

    from pdserve.planner.floors import copy_bandwidth, matmul_peak

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops, bw = matmul_peak(1024), copy_bandwidth(256 << 20)
    finally:
        torch.set_num_threads(before)
    return Hardware(
        "this-cpu", flops, bw, mem_bytes, bw / 4, bw / 4, 50e-6, 1e-3, 1.0, 1.0, gpu=False
    )
