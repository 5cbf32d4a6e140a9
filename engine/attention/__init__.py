"""Attention backends, chosen by name: ``torch`` (CPU and anywhere) or ``triton`` (CUDA).
The contract is ``backend.py``'s; this module names the backends and loads the one asked
for, importing nothing heavy itself (the cluster's config checks names with it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pdserve.engine.attention.backend import AttentionBackend
    from pdserve.engine.ops import Ops

BACKENDS = ("torch", "triton")


def default_backend_name(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


def get_backend(name: str) -> tuple[AttentionBackend, Ops]:
    """The attention backend called ``name`` and the op set that goes with it."""
    if name == "torch":
        from pdserve.engine.attention.torch_backend import TorchAttentionBackend
        from pdserve.engine.ops import TorchOps

        return TorchAttentionBackend(), TorchOps()
    if name == "triton":
        from pdserve.engine.attention.triton_backend import TritonAttentionBackend, TritonOps

        return TritonAttentionBackend(), TritonOps()
    raise ValueError(f"attention_backend={name!r}: allowed values are {', '.join(BACKENDS)}")


def latent_decode_op(name: str):
    """The ``paged_latent_decode`` of backend ``name``: decode attention over a
    latent/tied cache, one signature for all (contract: ``latent_torch.py``)."""
    if name == "torch":
        from pdserve.engine.attention.latent_torch import cpu_or_torch_latent_decode

        return cpu_or_torch_latent_decode
    if name == "triton":
        from pdserve.kernels.paged_latent_decode import paged_latent_decode

        return paged_latent_decode
    raise ValueError(f"attention_backend={name!r}: allowed values are {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "get_backend",
    "default_backend_name",
    "latent_decode_op",
]
