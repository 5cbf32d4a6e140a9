"""A sender's pair with one receiver: joining it through the receiver's store, and
checking later that the receiver behind the address is still the same one."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

from torch.distributed import PrefixStore, TCPStore

from kv_transfer.errors import KVPeerError
from kv_transfer.gloo.group import INFO_KEY, JOIN_QUEUE, layout_json, split_address
from kv_transfer.layout import KVLayout, KVLayoutError

log = logging.getLogger(__name__)


class SendPair:
    """A two-rank group with one receiver (this side is rank 0)."""

    def __init__(self, address: str, pg, info: dict, store, pack_bytes: int):
        self.address, self.pg, self.info, self.store = address, pg, info, store
        self.pack_bytes = min(pack_bytes, int(info.get("pack_bytes", pack_bytes)))
        self.lock = threading.Lock()
        self.broken: Exception | None = None
        self.acked_at = time.monotonic()  # when the receiver last answered (or joined)

    def alive(self) -> bool:
        """Whether the receiver this pair was formed with still serves its address (one
        store round trip): a restarted receiver has a new incarnation, a dead one none."""
        try:
            with self.lock:
                info = json.loads(self.store.get(INFO_KEY))
        except Exception:  # noqa: BLE001 - unreachable: gone
            return False
        return info.get("incarnation") == self.info.get("incarnation")


def connect(sender, address: str, dst_rank: int) -> SendPair:
    """Join the receiver at ``address`` (decode rank ``dst_rank``): read its layout from
    its store, push a join request, and build this side of the pair's group."""
    host, port = split_address(address)
    try:
        store = TCPStore(host, port, None, False, sender.connect_timeout)
        info = json.loads(store.get(INFO_KEY))
    except Exception as e:  # noqa: BLE001 - any failure to reach it means the same
        raise KVPeerError(f"cannot reach KV receiver {address}: {e}") from e
    theirs = KVLayout(**info["layout"])
    sender.layout.check_compatible(theirs)
    if theirs.tp_rank != dst_rank:
        raise KVLayoutError(
            f"KV receiver {address} is decode rank {theirs.tp_rank}, "
            f"but the destination lists it as rank {dst_rank}"
        )
    if info.get("backend") != sender.backend:
        raise KVPeerError(
            f"KV receiver {address} runs backend {info.get('backend')!r}, not {sender.backend!r}"
        )
    gen = uuid.uuid4().hex[:12]
    join = {
        "name": sender.name,
        "rank": sender.layout.tp_rank,
        "gen": gen,
        "host": sender.host,
        "layout": layout_json(sender.layout),
    }
    store.queue_push(JOIN_QUEUE, json.dumps(join))
    prefix = f"pair/{sender.name}/{sender.layout.tp_rank}/{gen}"
    try:
        pg = sender.group.make_group(
            PrefixStore(prefix, store), 0, sender.host, sender.connect_timeout
        )
    except Exception as e:  # noqa: BLE001
        raise KVPeerError(f"cannot form a group with KV receiver {address}: {e}") from e
    log.debug("kv pair %s -> %s formed (gen %s)", sender.name, address, gen)
    return SendPair(address, pg, info, store, sender.pack_bytes)
