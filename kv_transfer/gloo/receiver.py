"""Decode side of the ``gloo`` and ``nccl`` backends: a ``TCPStore`` server that senders
join through, one pair per sender rank (re-formed when that sender restarts), each read
by a ``PairReader`` in its own thread."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
import time
import uuid

import torch
from torch.distributed import PrefixStore, QueueEmptyError, TCPStore

from kv_transfer.blocks import BufferPool
from kv_transfer.gloo.group import (
    INFO_KEY,
    JOIN_QUEUE,
    POLL_S,
    GlooGroup,
    NcclGroup,
    abort,
    layout_json,
)
from kv_transfer.gloo.reader import PairReader
from kv_transfer.layout import KVLayout, KVLayoutError
from kv_transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class RecvPair:
    """A two-rank group with one sender rank (this side is rank 1)."""

    def __init__(self, key: tuple[str, int], gen: str, layout: KVLayout, host: str):
        self.key, self.gen, self.layout, self.host = key, gen, layout, host
        self.pg = None
        self.replaced = False
        self.thread: threading.Thread | None = None
        self.waiting = None  # a receive posted on this pair (there always is one)

    def break_(self) -> None:
        """Close this pair's connection, failing every receive posted on it, so no byte
        lands in their buffers afterwards. gloo's abort() does not wake a posted
        receive while the peer lives; a receive timing out closes the pair, so a 1 ms
        wait on any posted receive does."""
        work = self.waiting
        if work is not None:
            with contextlib.suppress(Exception):
                work.wait(datetime.timedelta(milliseconds=1))


class GlooReceiver(KVReceiver):
    """Decode side over torch.distributed point-to-point (gloo on CPU)."""

    backend = "gloo"
    group = GlooGroup

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        *,
        host: str | None = None,
        port: int = 0,
        connect_timeout: float = 30.0,
        slots: int = 4,
        pack_bytes: int = 4 << 20,
    ):
        super().__init__(layout, kv_cache)
        self.slots = slots  # header receives each pair keeps posted ahead
        self.pack_bytes = pack_bytes  # the largest pack senders may send
        self.pool = BufferPool(kv_cache.device)
        if kv_cache.device.type != self.group.device_type:
            raise KVLayoutError(
                f"the {self.backend} backend needs a {self.group.device_type} cache, "
                f"got {kv_cache.device}"
            )
        self.host = host or os.environ.get("PDSERVE_KV_HOST", "127.0.0.1")
        self.connect_timeout = datetime.timedelta(seconds=connect_timeout)
        self._store = TCPStore(
            self.host, port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
        )
        self.incarnation = uuid.uuid4().hex[:12]
        info = {
            "layout": layout_json(layout),
            "backend": self.backend,
            "incarnation": self.incarnation,
            "pack_bytes": pack_bytes,
        }
        self._store.set(INFO_KEY, json.dumps(info))
        self._address = f"{self.host}:{self._store.port}"
        self._closed = False
        self._pairs: dict[tuple[str, int], RecvPair] = {}
        self._pairs_lock = threading.Lock()
        self.generations: dict[tuple[str, int], int] = {}  # joins seen per sender rank
        self._accept = threading.Thread(
            target=self._accept_loop, name=f"kv-{self.backend}-accept", daemon=True
        )
        self._accept.start()

    @property
    def address(self) -> str:
        return self._address

    def pairs(self) -> dict[tuple[str, int], str]:
        """Live pairs: (sender name, sender rank) -> generation."""
        with self._pairs_lock:
            return {k: p.gen for k, p in self._pairs.items() if p.pg is not None}

    def _accept_loop(self) -> None:
        # After __init__ only this thread touches the store (its own connection), for the
        # join queue and for forming every pair, one at a time: torch's store client
        # sometimes needs seconds to connect (docs/kv_transfer.md), so the receiver makes
        # no new connection per pair. It polls the queue without blocking (a blocking pop
        # that times out logs warnings) every POLL_S, which also notices close().
        store = self._store
        store.set_timeout(self.connect_timeout)
        while not self._closed:
            try:
                raw = store.queue_pop(JOIN_QUEUE, False)
            except QueueEmptyError:
                time.sleep(POLL_S)
                continue
            except Exception as e:  # noqa: BLE001 - the store itself failed: nothing to serve
                if not self._closed:
                    log.error("KV receiver %s: join queue failed: %s", self._address, e)
                return
            msg = raw.decode()
            if self._closed:
                return
            try:
                join = json.loads(msg)
                theirs = KVLayout(**join["layout"])
                theirs.check_compatible(self.layout)
                pair = RecvPair((join["name"], int(join["rank"])), join["gen"], theirs, self.host)
            except Exception as e:  # noqa: BLE001 - a bad join must not stop the loop
                log.warning("KV receiver %s: refused join %r: %s", self._address, msg[:200], e)
                continue
            prefix = f"pair/{pair.key[0]}/{pair.key[1]}/{pair.gen}"
            try:
                pg = self.group.make_group(
                    PrefixStore(prefix, store), 1, self.host, self.connect_timeout
                )
            except Exception as e:  # noqa: BLE001 - the sender went away while joining
                log.warning("KV receiver %s: pair %s not formed: %s", self._address, prefix, e)
                continue
            with self._pairs_lock:
                old = self._pairs.get(pair.key)
                pair.pg = pg
                self._pairs[pair.key] = pair
                self.generations[pair.key] = self.generations.get(pair.key, 0) + 1
            if old is not None:  # the sender restarted: its old group is dead or dying
                old.replaced = True
                old.break_()
            pair.thread = threading.Thread(
                target=self._pair_loop,
                args=(pair, prefix),
                name=f"kv-{self.backend}-pair-{pair.key[0]}-{pair.key[1]}",
                daemon=True,
            )
            pair.thread.start()

    def _pair_loop(self, pair: RecvPair, prefix: str) -> None:
        try:
            PairReader(self, pair, pair.pg).serve()
        except Exception as e:  # noqa: BLE001
            if not (self._closed or pair.replaced):
                peer_gone = "closed by peer" in str(e) or "reset by peer" in str(e)
                (log.info if peer_gone else log.warning)(
                    "KV receiver %s: pair %s closed: %s", self._address, prefix, e
                )
        finally:
            with self._pairs_lock:
                if self._pairs.get(pair.key) is pair:
                    del self._pairs[pair.key]
            abort(pair.pg)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._pairs_lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            pair.replaced = True
            pair.break_()
        self._accept.join(timeout=POLL_S + self.connect_timeout.total_seconds())
        for pair in pairs:
            if pair.thread is not None:
                pair.thread.join(timeout=5)


class NcclReceiver(GlooReceiver):
    """Decode side over NCCL point-to-point: the same protocol on CUDA tensors."""

    backend = "nccl"
    group = NcclGroup
