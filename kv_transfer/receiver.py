"""``KVReceiver``: the decode side of one tensor-parallel rank, shared by every backend:
the transfers it expects, each one the state machine of docs/kv_transfer.md, and the
writes into its cache. A backend adds its ``address`` and the transport that feeds it
(``claim``/``commit``, ``end``, ``fail``, ``link_lost``).

    expect -> RESERVED -first byte-> RECEIVING -every segment and END-> LANDED
                                         |-- bad checksum, refused, link lost -> FAILED
                                         `-- no progress for lease_s ---------> EXPIRED
    release (any state): out of the book; no byte of it lands afterwards

RESERVED has no timer (the prefill may be queued; the owner releases it when the
prefill fails). The lease is the only timer: the first byte, END or report of another
rank starts it, each one renews it. LANDED, FAILED and EXPIRED are reported once, as an
``Outcome``, to ``on_event`` on the receiver's own thread; claims are refused from then
on. Rank 0 of a tensor-parallel instance expects ``ranks`` parts: its own and a report
from each other rank (``rank_event``).

Closed by default (docs/kv_transfer.md): a backend listens on ``bind`` only and tells
peers ``advertise``; it takes bytes only from a sender that proved the cluster's
``secret`` (``kv_transfer/auth.py``) and only for a transfer it expects, named on the
wire by the ``token`` that ``expect`` minted (never the transfer id), from the sending
instance ``expect`` names (a link's ``sender``, proved by its handshake); and it checks
every header field against the reservation and the layout before it allocates or
receives anything. A refused sender is logged and does not disturb the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from pdserve.kv_transfer.auth import check_secret, new_token
from pdserve.kv_transfer.layout import KVLayout, KVLayoutError
from pdserve.kv_transfer.protocol import (
    Handoff,
    KVChecksumError,
    KVPeerError,
    KVTransferError,
    KVTransferTimeout,
    Status,
    check_layer_skip,
    endpoint,
    status_of,
    transfer_key,
)
from pdserve.kv_transfer.routes import HeadRoute, routes_into
from pdserve.kv_transfer.segment import Segment, checksum, runs, scatter

log = logging.getLogger(__name__)


class State(Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    LANDED = "landed"
    FAILED = "failed"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Outcome:
    """A transfer that reached LANDED, FAILED or EXPIRED on this rank."""

    transfer_id: str
    state: State
    handoff: Handoff | None = None  # what source rank 0's END carried
    bytes: int = 0  # landed here (rank 0: and on the ranks that reported)
    seconds: float = 0.0  # first byte to last
    error: KVTransferError | None = None


@dataclass(eq=False)
class Transfer:
    """One expected transfer; ``have[route row, layer, position]`` says which segments
    (every part of one block, all of a route's units) have landed, or are not expected:
    positions before ``skip[layer]`` (``KVDestination.layer_skip``) start True, and a
    segment there is refused."""

    transfer_id: str
    key: int
    dst_block_ids: tuple[int, ...]
    src_tp: int
    routes: dict[tuple[int, tuple[int, int]], HeadRoute]  # by (source rank, global units)
    have: np.ndarray
    lease_s: float | None
    others: int  # other ranks still to report (rank 0)
    sender: str = ""  # the only sending instance whose links may feed it ("": any)
    skip: tuple[int, ...] = ()  # per layer, the leading positions not sent (empty: none)
    state: State = State.RESERVED
    deadline: float | None = None
    ended: set[int] = field(default_factory=set)  # source ranks whose END arrived
    handoff: Handoff | None = None
    links: set = field(default_factory=set)  # the connections that fed it
    first_at: float | None = None
    last_at: float | None = None
    bytes: int = 0
    inflight: set = field(default_factory=set)  # claims being written
    error: KVTransferError | None = None

    def __post_init__(self):
        self.rows = {key: i for i, key in enumerate(sorted(self.routes))}
        # source rank -> its rows
        self.sources: dict[int, list[int]] = {src: [] for src, _ in sorted(self.routes)}
        for (src, _), row in self.rows.items():
            self.sources[src].append(row)

    def share_landed(self, src_rank: int) -> bool:
        """Whether every segment of every route from ``src_rank`` landed."""
        return bool(self.have[self.sources[src_rank]].all())

    @property
    def live(self) -> bool:
        return self.state in (State.RESERVED, State.RECEIVING)

    def describe_missing(self) -> str:
        parts = []
        for src, rows in self.sources.items():
            v = np.flatnonzero(~self.have[rows].all(axis=(0, 2))).tolist()
            if v or src not in self.ended:
                spans = ",".join(
                    f"{v[i]}" + (f"-{v[i + n - 1]}" if n > 1 else "") for i, n in runs(v)
                )
                parts.append(f"{f'layers {spans}' if v else 'its END'} from source rank {src}")
        return "; ".join(parts) + (f"; {self.others} other rank(s)" if self.others else "")

    def complete(self) -> bool:
        return bool(self.have.all()) and len(self.ended) == len(self.sources) and not self.others


@dataclass(eq=False)
class Claim:
    """The right to write one segment of ``transfer`` from ``src_rank`` (``claim``)."""

    transfer: Transfer
    src_rank: int
    seg: Segment
    on_stuck: Callable[[], None] | None = None

    @property
    def dst_ids(self) -> tuple[int, ...]:
        return self.transfer.dst_block_ids[self.seg.start : self.seg.start + self.seg.count]

    @property
    def dst_heads(self) -> tuple[int, int]:
        return self.transfer.routes[self.src_rank, self.seg.heads].dst_heads


class KVReceiver:
    backend = ""

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        *,
        secret: bytes,
        bind: str | None = None,
        advertise: str | None = None,
        stuck_s: float = 5.0,
    ):
        """``secret``: the cluster's (``kv_transfer/auth.py``); ``bind``: the interface the
        backend listens on, ``advertise``: the address in ``address`` (``endpoint``)."""
        layout.check_cache(kv_cache)
        self.secret = check_secret(secret)
        self.bind, self.advertise = endpoint(bind, advertise)
        self.layout, self.kv_cache = layout, kv_cache  # the cache as the engine holds it
        self.units = layout.unit_view(kv_cache)  # [layers, parts, blocks, bs, units, dim]
        self.num_blocks = self.units.shape[2]
        self.layer_caches = [layer.unbind(0) for layer in self.units.unbind(0)]  # [layer][part]
        self.stuck_s = stuck_s  # how long a release waits for a write in progress
        self.on_event: Callable[[Outcome], None] | None = None
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # waits for writes, ends and releases
        self._clock = threading.Condition(lock)  # the watcher's: outcomes, a lease starting
        self._by_id: dict[str, Transfer] = {}
        self._by_key: dict[int, Transfer] = {}
        self._recent: OrderedDict[int, tuple[Status, str]] = OrderedDict()  # released
        self._events: deque[Outcome] = deque()
        self._closed = False
        self._watch = threading.Thread(target=self._watcher, name="kv-lease", daemon=True)
        self._watch.start()

    @property
    def address(self) -> str:
        raise NotImplementedError

    def _address_of(self, port: int) -> str:
        """``advertise:port`` (an IPv6 address in brackets)."""
        return f"[{self.advertise}]:{port}" if ":" in self.advertise else f"{self.advertise}:{port}"

    # -- the owner (the decode instance) ------------------------------------------------
    def expect(
        self,
        transfer_id,
        dst_block_ids,
        src_layout: KVLayout,
        lease_s=None,
        ranks=1,
        token: str | None = None,
        sender: str = "",
        layer_skip=(),
    ) -> str:
        """Reserve: the i-th source block lands in ``dst_block_ids[i]``, for layer ``l``
        from ``layer_skip[l]`` on (``KVDestination.layer_skip``); ``ranks`` parts
        (this rank's and ``ranks - 1`` reports through ``rank_event``) make it land.
        Returns the transfer's ``token`` (``KVDestination.token``): minted here, or the
        one given (rank 0's, for the other ranks of a tensor-parallel instance).
        ``sender``: the prefill instance whose links alone may feed it (a link's
        ``sender`` is the name its handshake proved); "" takes any proven link."""
        token = token or new_token()
        src_layout.check_compatible(self.layout)
        ids = tuple(int(b) for b in dst_block_ids)
        if bad := [b for b in ids if not 0 <= b < self.num_blocks]:
            raise KVLayoutError(
                f"transfer {transfer_id!r}: destination blocks {bad[:5]} are "
                f"outside the cache's {self.num_blocks} blocks"
            )
        if len(set(ids)) != len(ids):
            raise KVLayoutError(f"transfer {transfer_id!r}: destination blocks repeat: {ids}")
        skip = tuple(int(s) for s in layer_skip)
        check_layer_skip(skip, self.layout.num_layers, len(ids))
        routes = {(r.src_rank, r.heads): r for r in routes_into(self.layout, src_layout.tp_size)}
        have = np.zeros((len(routes), self.layout.num_layers, len(ids)), dtype=bool)
        for layer, n in enumerate(skip):  # nothing comes for them
            have[:, layer, :n] = True
        t = Transfer(
            transfer_id,
            transfer_key(token),
            ids,
            src_layout.tp_size,
            routes,
            have,
            lease_s,
            ranks - 1,
            sender,
            skip,
        )
        with self._cond:
            if transfer_id in self._by_id or t.key in self._by_key:
                raise KVTransferError(f"transfer {transfer_id!r} is already expected")
            self._by_id[transfer_id], self._by_key[t.key] = t, t
            self._recent.pop(t.key, None)
        return token

    def release(self, transfer_id: str) -> Outcome | None:
        """Take a transfer out of the book, whatever its state; None when it is not in.
        When this returns no byte of it is written any more: the blocks may be freed."""
        with self._cond:
            t = self._by_id.get(transfer_id)
            if t is not None:
                self._drop(t)
            return None if t is None else self._outcome(t)

    def rank_event(self, transfer_id: str, rank: int, nbytes: int, error: str | None) -> None:
        """Rank 0: another rank's part of the transfer landed (``error`` None) or failed."""
        with self._cond:
            t = self._by_id.get(transfer_id)
            if t is not None and t.live and error is not None:
                self._finish(t, State.FAILED, KVTransferError(f"decode rank {rank}: {error}"))
            elif t is not None and t.live:
                t.others, t.bytes = t.others - 1, t.bytes + nbytes
                self._progress(t)

    def wait(self, transfer_id: str, timeout: float) -> Outcome:
        """Block until the transfer landed, failed or expired (or ``timeout``), release it
        and return the outcome, or raise its error (``KVTransferTimeout`` on timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            t = self._by_id.get(transfer_id)
            if t is None:
                raise KVTransferError(
                    f"transfer {transfer_id!r} is not expected here (never "
                    "expected, already released or waited for)"
                )
            while t.live and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if t.live:
                self._finish(t, State.EXPIRED, self._timeout(t, f"within {timeout}s"))
            self._drop(t)
        if t.error is not None:
            raise t.error
        return self._outcome(t)

    def state(self, transfer_id: str) -> State | None:
        with self._cond:
            t = self._by_id.get(transfer_id)
            return None if t is None else t.state

    def pending(self) -> list[str]:
        with self._cond:
            return list(self._by_id)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._clock.notify()

    # -- the transport ----------------------------------------------------------------
    def claim(
        self, key, src_rank, src_layout: KVLayout, segs: Sequence[Segment], link=None, on_stuck=None
    ) -> tuple[list[Claim] | None, Status, str]:
        """The right to write ``segs`` (all or none) from one source rank: refused, with
        the status to acknowledge, unless the transfer expects bytes now and they fit it.
        Until ``commit``, a release waits for the write; if it hangs (a stalled sender),
        ``on_stuck`` is called to break it (it must make the write fail)."""
        with self._cond:
            t = self._by_key.get(key)
            if t is None or not t.live:
                return None, *self._status(t, key, src_rank)
            if problem := self._stranger(t, link):
                return None, Status.REJECTED, problem
            if problem := self._misfit(t, src_rank, src_layout, segs):
                self._finish(
                    t,
                    State.FAILED,
                    KVTransferError(f"transfer {t.transfer_id!r} rejected: {problem}"),
                )
                return None, Status.REJECTED, problem
            claims = [Claim(t, src_rank, s, on_stuck) for s in segs]
            t.inflight.update(claims)
            t.links.add(link)
            self._progress(t)
            return claims, Status.OK, ""

    def targets(self, c: Claim) -> tuple[torch.Tensor, ...] | None:
        """The regions of the cache (one per part, in the unit view) a claimed segment
        fills, when each is one contiguous tensor (consecutive blocks, all of this rank's
        units): receive there."""
        ids = c.dst_ids
        if c.dst_heads != (0, self.layout.units_per_rank) or runs(ids) != [(0, len(ids))]:
            return None
        return tuple(x[ids[0] : ids[0] + len(ids)] for x in self.layer_caches[c.seg.layer])

    def write(self, c: Claim, *parts: torch.Tensor) -> None:
        """Write a claimed segment's parts (K and V, or the latent row's columns)."""
        for cache, data in zip(self.layer_caches[c.seg.layer], parts, strict=True):
            scatter(cache, c.dst_ids, c.dst_heads, data)

    def write_layers(self, claims: Sequence[Claim], data: torch.Tensor) -> None:
        """``data`` ``[layers, parts, count, block_size, units, dim]``: the claims are
        consecutive layers at one block position."""
        c = claims[0]
        scatter(self.units[c.seg.layer : c.seg.layer + len(claims)], c.dst_ids, c.dst_heads, data)

    def verify(self, c: Claim, expected: int, *parts: torch.Tensor) -> bool:
        """Whether a claimed segment's bytes sum to what its sender sent; fails the
        transfer, naming the segment, when not."""
        got = checksum(*parts)
        if got != expected:
            s, t = c.seg, c.transfer
            self.fail(
                t.key,
                KVChecksumError(
                    f"KV transfer {t.transfer_id!r}: checksum mismatch in layer {s.layer}, blocks "
                    f"[{s.start}, {s.start + s.count}) from source rank {c.src_rank}: sent "
                    f"{expected:#018x}, received {got:#018x}"
                ),
            )
        return got == expected

    def commit(self, claims: Sequence[Claim], ok: bool) -> None:
        """End claims; when ``ok`` their segments count as landed (and renew the lease)."""
        with self._cond:
            landed = {}
            for c in claims:
                t = c.transfer
                t.inflight.discard(c)
                if ok and t.state == State.RECEIVING:
                    s = c.seg
                    row = t.rows[c.src_rank, s.heads]
                    t.have[row, s.layer, s.start : s.start + s.count] = True
                    t.bytes += self.layout.parts * s.count * self.layout.block_bytes(s.num_heads)
                    landed[id(t)] = t
            for t in landed.values():  # once per transfer, after all its claims ended
                self._progress(t)
            self._cond.notify_all()

    def end(self, key: int, src_rank: int, handoff: bytes, link=None) -> tuple[Status, str]:
        """A source's END (after all its data, on an in-order link): the status to
        acknowledge. A source whose share is incomplete at its END fails the transfer."""
        with self._cond:
            t = self._by_key.get(key)
            if t is not None and t.live and (problem := self._stranger(t, link)):
                return Status.REJECTED, problem
            if t is not None and t.live:
                t.links.add(link)
                if src_rank not in t.sources:
                    return Status.REJECTED, f"source rank {src_rank} has no heads for this rank"
                t.ended.add(src_rank)
                if handoff and src_rank == 0:
                    t.handoff = Handoff.from_bytes(handoff)
                if not t.share_landed(src_rank):
                    self._finish(
                        t,
                        State.FAILED,
                        KVTransferError(
                            f"KV transfer {t.transfer_id!r}: source rank {src_rank} ended with "
                            f"{t.describe_missing()} missing"
                        ),
                    )
                else:
                    self._progress(t)
            return self._status(t, key, src_rank)

    def fail(self, key: int, error: KVTransferError) -> None:
        with self._cond:
            t = self._by_key.get(key)
            if t is not None and t.live:
                self._finish(t, State.FAILED, error)

    def link_lost(self, link, src_rank: int, why: str) -> None:
        """The connection from ``src_rank`` broke: the transfers it was feeding and whose
        END from that rank had not come fail at once."""
        with self._cond:
            for t in list(self._by_id.values()):
                if t.live and link in t.links and src_rank not in t.ended:
                    self._finish(
                        t,
                        State.FAILED,
                        KVPeerError(f"KV transfer {t.transfer_id!r}: connection lost ({why})"),
                    )

    # -- internals (lock held) ------------------------------------------------------------
    def _stranger(self, t: Transfer, link) -> str:
        """Why ``link`` may not feed ``t`` ("" when it may): it proved another sender's
        name. Refused without failing ``t``: the expected sender may still come."""
        sender = getattr(link, "sender", "")
        if t.sender and sender != t.sender:
            log.warning(
                "KV transfer %r: bytes from %r refused, it expects %r",
                t.transfer_id,
                sender[:64],
                t.sender,
            )
            return f"this transfer is expected from {t.sender!r}, not {sender[:64]!r}"
        return ""

    def _misfit(self, t: Transfer, src_rank: int, src_layout: KVLayout, segs) -> str:
        """Why segments from ``src_rank`` do not belong in ``t`` ("" when they do)."""
        try:
            src_layout.check_compatible(self.layout)
        except KVLayoutError as e:
            return str(e)
        if src_layout.tp_size != t.src_tp:
            return (
                f"sender has tensor_parallel={src_layout.tp_size}, the transfer was "
                f"expected from tensor_parallel={t.src_tp}"
            )
        if src_rank not in t.sources:
            return f"source rank {src_rank} holds no heads of this decode rank"
        for s in segs:
            if (src_rank, s.heads) not in t.routes:
                expected = [h for src, h in t.routes if src == src_rank]
                return f"source rank {src_rank} sent heads {s.heads}, expected one of {expected}"
            if not 0 <= s.layer < self.layout.num_layers:
                return f"layer {s.layer} is outside the cache"
            if s.start < 0 or s.count < 1 or s.start + s.count > len(t.dst_block_ids):
                return (
                    f"blocks [{s.start}, {s.start + s.count}) are outside the transfer's "
                    f"{len(t.dst_block_ids)} blocks"
                )
            if t.skip and s.start < t.skip[s.layer]:
                return (
                    f"blocks [{s.start}, {s.start + s.count}) of layer {s.layer}: that "
                    f"layer receives blocks [{t.skip[s.layer]}, {len(t.dst_block_ids)}) "
                    "only (layer_skip: the rest lie before its window)"
                )
        return ""

    def _progress(self, t: Transfer) -> None:
        now = time.monotonic()
        t.first_at, t.last_at = t.first_at or now, now
        if t.lease_s is not None:
            if t.deadline is None:  # the clock starts (a renewal only moves it later)
                self._clock.notify()
            t.deadline = now + t.lease_s
        if t.state == State.RESERVED:
            t.state = State.RECEIVING
        if t.complete() and not t.inflight:
            self._finish(t, State.LANDED, None)

    def _finish(self, t: Transfer, state: State, error: KVTransferError | None) -> None:
        t.state, t.error = state, error
        self._events.append(self._outcome(t))
        self._cond.notify_all()
        self._clock.notify()

    def _outcome(self, t: Transfer) -> Outcome:
        first, last = t.first_at or 0.0, t.last_at or 0.0
        return Outcome(t.transfer_id, t.state, t.handoff, t.bytes, last - first, t.error)

    def _timeout(self, t: Transfer, when: str) -> KVTransferTimeout:
        skipped = len(t.rows) * sum(t.skip)  # never expected
        have, size = int(t.have.sum()) - skipped, t.have.size - skipped
        return KVTransferTimeout(
            f"KV transfer {t.transfer_id!r} made no progress {when} ({have}/{size} "
            f"segments landed); missing {t.describe_missing()}. The reservation is released."
        )

    def _status(self, t: Transfer | None, key: int, src_rank: int) -> tuple[Status, str]:
        """How a source's share stands: what its END's acknowledgement says."""
        if t is None:
            return self._recent.get(key, (Status.UNKNOWN, "transfer not expected"))
        if t.error is not None:
            return status_of(t.error), str(t.error)
        if src_rank not in t.sources:
            return Status.REJECTED, f"source rank {src_rank} has no heads for this rank"
        if not t.share_landed(src_rank):
            return Status.INCOMPLETE, f"missing {t.describe_missing()}"
        return Status.OK, ""

    def _drop(self, t: Transfer) -> None:
        """Unregister ``t`` once no write into its blocks is in progress."""
        if self._by_id.get(t.transfer_id) is not t:
            return
        del self._by_id[t.transfer_id], self._by_key[t.key]
        for phase in ("wait", "break"):
            deadline = time.monotonic() + self.stuck_s
            while t.inflight and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if not t.inflight:
                break
            for c in list(t.inflight) if phase == "wait" else ():  # a write hangs: break it
                if c.on_stuck is not None:
                    c.on_stuck()
        if t.inflight:
            log.error("transfer %r released with %d writes pending", t.transfer_id, len(t.inflight))
        if t.live:
            self._recent[t.key] = (Status.UNKNOWN, "released before it completed")
        else:
            self._recent[t.key] = self._status(t, t.key, min(t.sources, default=0))
        while len(self._recent) > 4096:
            self._recent.popitem(last=False)

    def _watcher(self) -> None:
        """The lease's clock, and the delivery of outcomes to ``on_event``."""
        while True:
            with self._cond:
                while not self._events and not self._closed:
                    now = time.monotonic()
                    due = [
                        (t.deadline, t)
                        for t in self._by_id.values()
                        if t.state == State.RECEIVING and t.deadline is not None
                    ]
                    for t in [t for at, t in due if at <= now]:
                        self._finish(t, State.EXPIRED, self._timeout(t, f"for {t.lease_s:g}s"))
                    if self._events:
                        break
                    self._clock.wait(min((at - now for at, _ in due), default=None))
                if self._closed:
                    return
                events, self._events = list(self._events), deque()
            for outcome in events:
                if self.on_event is not None:
                    try:
                        self.on_event(outcome)
                    except Exception:  # the owner's bug must not stop the clock
                        log.exception("KV receiver: on_event failed for %s", outcome.transfer_id)
