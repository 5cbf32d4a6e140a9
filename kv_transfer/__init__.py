"""KV cache transfer between the prefill and decode pools (docs/kv_transfer.md).

Contract
--------
Prefill side, one ``KVSender`` per tensor-parallel rank (its ``KVLayout``):

* ``send_layer(transfer_id, layer, k_cache, v_cache, src_block_ids, dst)`` sends this
  rank's share of one layer of a request to every decode rank whose heads intersect
  its own (``layout.routes_from``). It returns once the data is handed to the
  transport, not when it arrived, so the forward pass calls it right after the layer
  is computed (layer-wise); ``send_all`` sends every layer of the cache at once.
* ``finish(transfer_id, handoff, timeout)`` sends the END (source rank 0's carries the
  ``Handoff``: what decode needs to run the request) and waits until every decode rank
  it went to answered that its share landed: a ``TransferAck``, else a
  ``KVTransferError``. Until then the source blocks must not be overwritten.
* ``abort(transfer_id)`` forgets a transfer without an END.

Decode side, one ``KVReceiver`` per tensor-parallel rank, owning its cache tensor:

* ``address`` is where senders reach it; the decode instance publishes it in the
  ``KVDestination`` of its reservations.
* ``expect(transfer_id, dst_block_ids, src_layout, lease_s, ranks)`` reserves before
  the transfer can arrive. The transfer then goes RESERVED -> RECEIVING -> LANDED (every
  segment from every source rank, every END, every other rank's report), or FAILED /
  EXPIRED; each end is reported once to ``on_event`` as an ``Outcome``.
* ``release(transfer_id)`` takes it out whatever its state; once it returns no byte of
  it is written any more, so the blocks may be freed. ``wait`` blocks until the
  transfer ended, releases it and returns its outcome or raises its error.

Backends are chosen by name (``kv_transfer.backend``): ``gloo``, ``nccl`` and ``grpc``,
or ``package.module:attribute`` naming a ``Transport`` defined elsewhere (the tests'
fault-injecting transport). Groups are formed per (sender, receiver) pair when they
first talk, never as one world frozen at launch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kv_transfer.layout import (
    HeadRoute,
    KVLayout,
    KVLayoutError,
    all_routes,
    routes_from,
    routes_into,
)
from kv_transfer.protocol import (
    Handoff,
    KVChecksumError,
    KVDestination,
    KVPeerError,
    KVTransferError,
    KVTransferTimeout,
    Status,
)
from kv_transfer.receiver import KVReceiver, Outcome, State
from kv_transfer.sender import Ack, KVSender, TransferAck


@dataclass(frozen=True)
class Transport:
    """A backend: its sender and receiver classes."""

    name: str
    sender: type[KVSender]
    receiver: type[KVReceiver]


BACKENDS = {  # name: (module, sender class, receiver class)
    "gloo": ("gloo_sender:GlooSender", "gloo_receiver:GlooReceiver"),
    "nccl": ("gloo_sender:NcclSender", "gloo_receiver:NcclReceiver"),
    "grpc": ("grpc_sender:GrpcSender", "grpc_receiver:GrpcReceiver"),
}


def get_transport(name: str) -> Transport:
    """The backend named by ``kv_transfer.backend``."""
    if name in BACKENDS:
        classes = []
        for path in BACKENDS[name]:
            module, _, cls = path.partition(":")
            classes.append(getattr(importlib.import_module(f"kv_transfer.{module}"), cls))
        return Transport(name, *classes)
    module, _, attr = name.partition(":")
    if not (module and attr):
        raise ValueError(
            f"kv_transfer.backend={name!r} is not one of {list(BACKENDS)} "
            "(or a 'package.module:attribute' naming a Transport)"
        )
    transport = getattr(importlib.import_module(module), attr)
    if not isinstance(transport, Transport):
        raise ValueError(f"kv_transfer.backend={name!r} names a {type(transport).__name__}, "
                         "not a kv_transfer.Transport")  # fmt: skip
    return transport


__all__ = [
    "BACKENDS",
    "Ack",
    "Handoff",
    "HeadRoute",
    "KVChecksumError",
    "KVDestination",
    "KVLayout",
    "KVLayoutError",
    "KVPeerError",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "KVTransferTimeout",
    "Outcome",
    "State",
    "Status",
    "TransferAck",
    "Transport",
    "all_routes",
    "get_transport",
    "routes_from",
    "routes_into",
]
