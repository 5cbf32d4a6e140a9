"""The gloo/nccl wire format: message tags and the int64 header (no pickle, no strings).

A header is ``HDR_LEN`` int64 words: 8 fields (``H_*``), then a table of up to
``MAX_SEGS`` segment rows of ``ROW`` words (``S_*``). Kinds: ``DATA`` (segments follow),
``END`` (a transfer's last header from one source rank), ``ACK`` (the receiver's answer
to ``END``: a status, and up to ``MSG_LEN`` bytes of UTF-8 text in place of the table)
and ``BYE`` (the sender closes).
"""

from __future__ import annotations

import struct
from enum import IntEnum

MAGIC = 0x4B5633  # "KV3"
MSG_LEN = 256
TAG_HDR, TAG_DATA, TAG_ACK, TAG_PACK = 1, 2, 3, 4


class Kind(IntEnum):
    DATA = 1
    END = 2
    ACK = 3
    BYE = 4


# H_PACK: bytes of the one packed message that follows a DATA header (0: none)
H_MAGIC, H_KIND, H_KEY, H_SRC_RANK, H_NSEGS, H_STATUS, H_SEGMENTS, H_PACK = range(8)
# S_OFFSET: where K (then V) starts in the pack, or NOT_PACKED: K and V follow as two
# messages of their own
S_LAYER, S_START, S_COUNT, S_HEAD0, S_HEAD1, S_NBYTES, S_HAS_SUM, S_SUM, S_OFFSET = range(9)
ROW = 9
MAX_SEGS = 32
HDR_LEN = 8 + ROW * MAX_SEGS
NOT_PACKED = -1


def header(kind: Kind, key: int, src_rank: int, segments: int = 0) -> list[int]:
    h = [0] * HDR_LEN
    h[H_MAGIC], h[H_KIND], h[H_KEY] = MAGIC, int(kind), key
    h[H_SRC_RANK], h[H_SEGMENTS] = src_rank, segments
    return h


def ack(key: int, src_rank: int, status: int, text: str) -> list[int]:
    """An ACK header; the text (cut to ``MSG_LEN`` bytes) where a DATA header's table is."""
    h = header(Kind.ACK, key, src_rank)
    raw = text.encode()[:MSG_LEN]
    words = -(-len(raw) // 8)
    h[H_STATUS], h[H_SEGMENTS] = status, len(raw)
    h[8 : 8 + words] = struct.unpack(f"<{words}q", raw.ljust(8 * words, b"\0"))
    return h


def ack_text(h: list[int]) -> str:
    n = min(max(h[H_SEGMENTS], 0), MSG_LEN)
    words = -(-n // 8)
    return struct.pack(f"<{words}q", *h[8 : 8 + words])[:n].decode("utf-8", "replace")


def rows(h: list[int]) -> list[list[int]]:
    """The segment rows of a DATA header."""
    n = h[H_NSEGS]
    if not 0 < n <= MAX_SEGS:
        raise RuntimeError(f"header announces {n} segments")
    return [h[8 + ROW * i : 8 + ROW * (i + 1)] for i in range(n)]


def signed(u: int) -> int:
    """An unsigned 64-bit value as the int64 word that carries it."""
    return u - (1 << 64) if u >= 1 << 63 else u


def unsigned(s: int) -> int:
    return s & ((1 << 64) - 1)


def layer_spans(rows: list[tuple[int, int, int, int, int, int]]) -> list[tuple[int, int]]:
    """``[i, j)`` ranges of packed rows (``(layer, start, count, head0, offset, nbytes)``,
    in table order) that lie in the pack as one ``[layers, 2, count, ...]`` tensor:
    consecutive layers at one block position and head range, each K then V."""
    spans: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        if spans and spans[-1][1] == i:
            prev = rows[i - 1]
            if (row[0], row[1:4], row[4]) == (prev[0] + 1, prev[1:4], prev[4] + 2 * prev[5]):
                spans[-1] = (spans[-1][0], i + 1)
                continue
        spans.append((i, i + 1))
    return spans
