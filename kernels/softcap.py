"""Soft-capping of attention scores inside the Triton attention kernels (Gemma 2)."""

import triton
import triton.language as tl


@triton.jit
def softcap_scores(s, cap):
    """cap * tanh(s / cap) lane-wise, as cap * (2 sigmoid(2 s / cap) - 1): saturates to
    +-cap. The kernels keep scores in base 2 (scale * q . k * log2 e), so they pass
    cap = softcap * log2 e, which caps the natural-base score at softcap."""
    return (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0) * cap
