"""Content hashes of full KV blocks, the keys of the prefix cache (docs/serving.md,
"Prefix caching").

A block's hash covers its own tokens and, through its parent's hash, every token before
it: equal hashes mean equal token prefixes, hence equal KV (same model, same positions).
The hash is blake2b (8 bytes) over the parent's hash and the tokens as little-endian
int32: stable across processes, hosts and Python versions, so the router computes the
same keys as every engine (cache-aware routing) without asking them.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROOT = 0  # the parent hash of a sequence's first block


def block_hashes(token_ids: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """The chained hash of each full block of ``token_ids`` (a trailing partial block has
    none); ``parent``: the hash of the block before ``token_ids[0]`` (None: they start
    the sequence)."""
    out, prev = [], ROOT if parent is None else parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = np.asarray(token_ids[start : start + block_size], dtype="<i4")
        digest = hashlib.blake2b(prev.to_bytes(8, "little"), digest_size=8)
        digest.update(tokens.tobytes())
        prev = int.from_bytes(digest.digest(), "little")
        out.append(prev)
    return out
