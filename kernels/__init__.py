"""Triton kernels of the serving engine, each with a plain-torch ``ref_*`` beside it.

This package imports nothing from the rest of the project. Set ``TRITON_INTERPRET=1``
before importing it to run the kernels on CPU tensors.
"""

from kernels.activation import ref_silu_and_mul, silu_and_mul
from kernels.kv_cache_write import ref_gather_kv, ref_write_kv_cache, write_kv_cache
from kernels.paged_decode_attention import paged_decode_attention, ref_paged_decode_attention
from kernels.paged_latent_decode import paged_latent_decode, ref_paged_latent_decode
from kernels.paged_prefill_attention import paged_prefill_attention, ref_paged_prefill_attention
from kernels.rms_norm import add_rms_norm, ref_add_rms_norm, ref_rms_norm, rms_norm
from kernels.rotary import ref_rotary, rotary

__all__ = [
    "add_rms_norm",
    "paged_decode_attention",
    "paged_latent_decode",
    "paged_prefill_attention",
    "ref_add_rms_norm",
    "ref_gather_kv",
    "ref_paged_decode_attention",
    "ref_paged_latent_decode",
    "ref_paged_prefill_attention",
    "ref_rms_norm",
    "ref_rotary",
    "ref_silu_and_mul",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "write_kv_cache",
    "ref_write_kv_cache",
]
