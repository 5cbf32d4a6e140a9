"""What both ends of a gloo/nccl pair share: message tags, the int64 header and its
``Segment`` rows, the two-rank groups, and how a sender packs segments into batches.
A segment's parts (K and V, or a latent cache's row: ``KVLayout.parts``) travel one
after the other.

A header is ``HDR_LEN`` int64 words: ``HEAD`` fields (``H_*``), then up to ``MAX_SEGS``
rows of ``ROW`` words (``S_*``), one per segment. Kinds: ``DATA`` (segments follow: a
pack of ``H_AUX`` bytes, tag ``TAG_PACK``, then each part of each segment not packed,
tag ``TAG_DATA``), ``END`` (a transfer's last header from one source rank; ``H_AUX``
bytes of handoff follow, tag ``TAG_END``), ``ACK`` (the receiver's answer to an END:
a ``Status`` and ``H_AUX`` bytes of UTF-8 text in place of the rows) and ``BYE`` (the
sender closes). No pickle, no strings but the ACK's text.

gloo pays per message (a rendezvous, wake-ups on both sides), a pack per byte (a gather
here, a copy out of staging there). So a segment whose parts are each one region of
the cache, of at least ``direct_from`` bytes, goes straight from the cache as a message
per part; the others are gathered into packs of at most ``pack_limit`` bytes, one per
batch, so a batch goes out as soon as its pack is full and the next is gathered while
the transport moves this one.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, cast

import torch

from pdserve.kv_transfer.protocol import KVPeerError
from pdserve.kv_transfer.segment import Segment, Source, typed

MAGIC = 0x4B5634  # "KV4"
MSG_LEN = 256  # most bytes of ACK text
MAX_HANDOFF = 1 << 20  # most bytes of handoff an END may announce
TAG_HDR, TAG_DATA, TAG_ACK, TAG_PACK, TAG_END = 1, 2, 3, 4, 5
FOREVER = datetime.timedelta(days=365)  # an idle pair waits this long for its next header
# A pair forms within this once its join is pushed: both sides are up and meet through
# the receiver's store. Past it the other side counts as gone: the sender's transfer
# fails over (KVPeerError), the receiver's accept loop moves on to the next join.
PAIR_FORM = datetime.timedelta(seconds=5)


class Kind(IntEnum):
    DATA = 1
    END = 2
    ACK = 3
    BYE = 4


H_MAGIC, H_KIND, H_KEY, H_SRC_RANK, H_NSEGS, H_STATUS, H_AUX = range(7)
# S_OFFSET: where K (then V) starts in the pack, or NOT_PACKED (two messages of its own)
S_LAYER, S_START, S_COUNT, S_HEAD0, S_HEAD1, S_HAS_SUM, S_SUM, S_OFFSET = range(8)
HEAD, ROW, MAX_SEGS = 7, 8, 32
HDR_LEN = HEAD + ROW * MAX_SEGS
NOT_PACKED = -1


def header(kind: Kind, key: int, src_rank: int, aux: int = 0) -> list[int]:
    h = [0] * HDR_LEN
    h[H_MAGIC], h[H_KIND], h[H_KEY], h[H_SRC_RANK], h[H_AUX] = MAGIC, int(kind), key, src_rank, aux
    return h


def put_row(h: list[int], i: int, seg: Segment, total: int | None, offset: int) -> None:
    """Row ``i``: the segment, its checksum (None: not summed), its place in the pack."""
    signed = 0 if total is None else total - (1 << 64) if total >= 1 << 63 else total
    h[HEAD + ROW * i : HEAD + ROW * (i + 1)] = [
        seg.layer,
        seg.start,
        seg.count,
        seg.heads[0],
        seg.heads[1],
        int(total is not None),
        signed,
        offset,
    ]
    h[H_NSEGS] = max(h[H_NSEGS], i + 1)


def rows(
    h: list[int], num_layers: int, max_blocks: int, num_heads: int
) -> list[tuple[Segment, int | None, int]]:
    """The (segment, checksum or None, pack offset) rows of a DATA header, each checked
    against the receiver's cache before anything is allocated for it: a layer of its
    ``num_layers``, 1 to ``max_blocks`` blocks (its cache's), units inside the model's
    ``num_heads`` (``KVLayout.units``). A RuntimeError names the row, the field, its
    value and the bound."""
    n = h[H_NSEGS]
    if not 0 < n <= MAX_SEGS:
        raise RuntimeError(f"header announces {n} segments; allowed: 1 to {MAX_SEGS}")
    out = []
    for i in range(n):
        r = h[HEAD + ROW * i : HEAD + ROW * (i + 1)]
        for name, value, low, high in (
            ("layer", r[S_LAYER], 0, num_layers - 1),
            ("start", r[S_START], 0, max_blocks - 1),
            ("count", r[S_COUNT], 1, max_blocks),
            ("head_start", r[S_HEAD0], 0, num_heads - 1),
            ("head_end", r[S_HEAD1], r[S_HEAD0] + 1, num_heads),
        ):
            if not low <= value <= high:
                raise RuntimeError(f"header row {i}: {name}={value}; allowed: {low} to {high}")
        seg = Segment(r[S_LAYER], r[S_START], r[S_COUNT], (r[S_HEAD0], r[S_HEAD1]))
        out.append((seg, r[S_SUM] & ((1 << 64) - 1) if r[S_HAS_SUM] else None, r[S_OFFSET]))
    return out


def ack(key: int, src_rank: int, status: int, text: str) -> list[int]:
    raw = text.encode()[:MSG_LEN]
    words = -(-len(raw) // 8)
    h = header(Kind.ACK, key, src_rank, len(raw))
    h[H_STATUS] = status
    h[HEAD : HEAD + words] = struct.unpack(f"<{words}q", raw.ljust(8 * words, b"\0"))
    return h


def ack_text(h: list[int]) -> str:
    n = min(max(h[H_AUX], 0), MSG_LEN)
    words = -(-n // 8)
    return struct.pack(f"<{words}q", *h[HEAD : HEAD + words])[:n].decode("utf-8", "replace")


def layer_spans(keys: list[tuple], parts: int) -> list[tuple[int, int]]:
    """``[i, j)`` ranges of packed rows (``(segment, offset, nbytes)``, ``nbytes`` per
    part, in table order) that lie in the pack as one ``[layers, parts, count, ...]``
    tensor: consecutive layers at one position and unit range, each its parts in turn."""
    spans: list[tuple[int, int]] = []
    for i, (seg, off, _) in enumerate(keys):
        if spans and spans[-1][1] == i:
            prev, prev_off, prev_n = keys[i - 1]
            same = (seg.start, seg.count, seg.heads) == (prev.start, prev.count, prev.heads)
            if same and seg.layer == prev.layer + 1 and off == prev_off + parts * prev_n:
                spans[-1] = (spans[-1][0], i + 1)
                continue
        spans.append((i, i + 1))
    return spans


@dataclass
class Batch:
    """One header's segments: (segment, bytes of one part, pack offset or ``NOT_PACKED``)."""

    rows: list[tuple[Segment, int, int]] = field(default_factory=list)
    pack_bytes: int = 0


def plan_batches(
    segs,
    source: Source,
    per_head_block: int,
    pack_limit: int,
    direct_from: int,
    most_bytes: int | None,
    parts: int,
) -> list[Batch]:
    """Batches of up to ``MAX_SEGS`` segments, one pack, and ``most_bytes`` of data;
    ``per_head_block``: bytes of one unit of one block of one part."""
    out, batch, data = [], Batch(), 0
    for seg in segs:
        nbytes = seg.count * seg.num_heads * per_head_block
        direct = (
            nbytes >= direct_from and source.views(seg) is not None
        ) or parts * nbytes > pack_limit
        full = len(batch.rows) == MAX_SEGS or bool(
            most_bytes and batch.rows and data + parts * nbytes > most_bytes
        )
        grows = batch.pack_bytes + parts * nbytes
        if full or (not direct and batch.pack_bytes and grows > pack_limit):
            out.append(batch)
            batch, data = Batch(), 0
        data += parts * nbytes
        batch.rows.append((seg, nbytes, NOT_PACKED if direct else batch.pack_bytes))
        batch.pack_bytes += 0 if direct else parts * nbytes
    return out + ([batch] if batch.rows else [])


def fill_pack(
    pack: torch.Tensor, batch: Batch, source: Source, dtype: torch.dtype, parts: int
) -> None:
    """Gather the batch's packed segments into ``pack``: consecutive layers at one
    position with one copy when they come from one cache."""
    packed = [(seg, off, n) for seg, n, off in batch.rows if off != NOT_PACKED]
    for i, j in layer_spans(packed, parts):
        seg, off, n = packed[i]
        shape = source.shape(seg)
        if source.gather_layers(
            [s for s, _, _ in packed[i:j]], typed(pack[off:], dtype, (j - i, parts, *shape))
        ):
            continue
        for seg, off, n in packed[i:j]:
            source.gather(seg, [typed(pack[off + p * n :], dtype, shape) for p in range(parts)])


class GlooGroup:
    """Builds two-rank gloo groups; ``NcclGroup`` swaps the group type and the device."""

    device_type = "cpu"
    tagged = True  # messages match per tag (NCCL: in order, tags ignored)

    @staticmethod
    def make_group(store, rank: int, host: str, timeout: datetime.timedelta):
        from torch.distributed import ProcessGroupGloo

        # the pybind options that take a device: torch's stubs declare another class
        opts = cast(Any, ProcessGroupGloo)._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return ProcessGroupGloo(store, rank, 2, opts)

    @staticmethod
    def sync(tensor: torch.Tensor | None = None) -> None:
        """After a device transfer: make its buffers safe to read or write again."""


class NcclGroup(GlooGroup):
    device_type = "cuda"
    tagged = False

    @staticmethod
    def make_group(store, rank: int, host: str, timeout: datetime.timedelta):
        if not torch.cuda.is_available():
            raise KVPeerError("the nccl KV backend needs CUDA; use gloo or grpc on CPU")
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = FOREVER  # an idle receiver keeps a header recv posted
        return ProcessGroupNCCL(store, rank, 2, opts)

    @staticmethod
    def sync(tensor: torch.Tensor | None = None) -> None:
        torch.cuda.current_stream(None if tensor is None else tensor.device).synchronize()


def abort(pg) -> None:
    if pg is not None:
        with contextlib.suppress(Exception):  # already gone
            pg.abort()


def listening_store(bind: str, port: int, timeout: datetime.timedelta):
    """A ``TCPStore`` server listening on ``bind`` only. torch's stores (libuv or not)
    listen on every interface whatever host they are given, so the socket is bound here
    and handed over (``master_listen_fd``: the store keeps it as it is, and closes it)."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own stores
        sock.bind((bind, port))
        sock.listen(128)
        store = TCPStore(
            bind,
            sock.getsockname()[1],
            None,
            True,
            timeout,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's now
    return store


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"KV receiver address {address!r} is not host:port")
    return host.strip("[]"), int(port)
