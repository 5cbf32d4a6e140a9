"""The per-chunk checksum: a wrapping 64-bit sum of the chunk's bytes read as int64 words.

Cheap (one read at memory bandwidth, ~20 GB/s on CPU; it runs on the GPU for device
tensors) and enough for what it guards: any bit flipped, bytes lost, zeroed or cut
short on the way. It does not see two whole 8-byte words trading places; ordering is
the transport's job (in-order streams) and the bit-exact tests'.
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1
_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))


def checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 tensor (on ``t``'s device): the wrapping sum of ``t``'s bytes as words.

    ``t`` must be contiguous. The word width depends on the byte count alone (8 bytes,
    or narrower when the size is not a multiple of 8), so both ends agree whatever the
    alignment of their buffers; an unaligned view is copied first (rare: blocks are
    multiples of 8 bytes).
    """
    flat = t.reshape(-1).view(torch.uint8)
    n = flat.numel()
    word = next(w for w, size in _WORDS if n % size == 0)
    try:
        words = flat.view(word)
    except RuntimeError:  # storage offset not a multiple of the word
        words = flat.clone().view(word)
    return words.sum(dtype=torch.int64)


def checksum(t: torch.Tensor) -> int:
    """The checksum as an unsigned 64-bit Python int."""
    return int(checksum_tensor(t)) & _MASK


def combine(*values: int) -> int:
    return sum(values) & _MASK
