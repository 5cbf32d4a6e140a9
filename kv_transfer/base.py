"""The KV transfer interface every backend implements, and the registry that picks one.

Contract
--------
Prefill side, one ``KVSender`` per tensor-parallel rank (its ``KVLayout``):

* ``send_layer(transfer_id, layer, k_cache, v_cache, src_block_ids, dst)`` sends this
  rank's share of one layer of a request: for every decode rank whose heads intersect
  this rank's (``head_map.routes_from``), the blocks ``src_block_ids`` of
  ``k_cache``/``v_cache`` (this layer's ``[blocks, block_size, local heads, head_dim]``
  views, ``ModelRunner.kv_caches[layer]``), restricted to those heads. It returns once
  the data is handed to the transport (packed or referenced), not when it has arrived,
  so it can be called from the forward pass right after the layer is computed
  (layer-wise). Layers go in any order, each exactly once per transfer. ``block_offset``
  places ``src_block_ids`` at that position of the request's block list, for callers
  that send a request's blocks in parts.
* ``finish(transfer_id, timeout)`` waits until every byte sent for the transfer has been
  received and acknowledged by every decode rank it went to; returns a ``TransferAck``,
  raises a ``KVTransferError`` (``KVChecksumError``, ``KVPeerError``,
  ``KVTransferTimeout``) otherwise. Until it returns, the source blocks must not be
  overwritten (a backend may send straight from the cache).
* ``abort(transfer_id)`` forgets a transfer without waiting (the receiver's lease cleans up).

Decode side, one ``KVReceiver`` per tensor-parallel rank, owning its cache tensor:

* ``address``: where senders reach it (``host:port``); the decode instance publishes it
  in the ``KVDestination`` of its reservations.
* ``expect(transfer_id, dst_block_ids, src_layout, lease_s)`` before the transfer can
  arrive (at reservation time): the i-th source block lands in ``dst_block_ids[i]``,
  heads placed by ``head_map.routes_into``. Bytes of transfers not expected are dropped.
* ``wait(transfer_id, timeout)`` returns ``TransferStats`` when every layer from every
  source rank has landed; raises ``KVTransferTimeout`` (naming what is missing) or
  ``KVChecksumError``. The transfer leaves the receiver either way (also through
  ``cancel`` and ``reap_expired``), and no byte of it is written afterwards, so the
  caller may free or reuse the blocks at once.

Groups are formed per (sender, receiver) pair when they first talk, never as one world
frozen at launch: a restarted or new worker on either side just connects.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import Ack, KVSender, TransferAck

__all__ = [
    "BACKENDS",
    "Ack",
    "KVReceiver",
    "KVSender",
    "TransferAck",
    "Transport",
    "get_transport",
]


@dataclass(frozen=True)
class Transport:
    """A backend: its sender and receiver classes."""

    name: str
    sender: type[KVSender]
    receiver: type[KVReceiver]


_BACKENDS = {  # name: (sender class, receiver class) as "module:Class"
    "gloo": ("kv_transfer.gloo.sender:GlooSender", "kv_transfer.gloo.receiver:GlooReceiver"),
    "nccl": ("kv_transfer.gloo.sender:NcclSender", "kv_transfer.gloo.receiver:NcclReceiver"),
    "grpc": (
        "kv_transfer.grpc_transport.sender:GrpcSender",
        "kv_transfer.grpc_transport.receiver:GrpcReceiver",
    ),
}
BACKENDS = tuple(_BACKENDS)


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def get_transport(name: str) -> Transport:
    """The backend named by ``kv_transfer.backend``: ``gloo``, ``nccl`` or ``grpc``."""
    if name not in _BACKENDS:
        raise ValueError(f"kv_transfer.backend={name!r} is not one of {list(_BACKENDS)}")
    sender, receiver = _BACKENDS[name]
    return Transport(name, _load(sender), _load(receiver))
