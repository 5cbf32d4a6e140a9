"""KV cache transfer between the prefill and decode pools (docs/kv_transfer.md).

Prefill side, one ``KVSender`` per tensor-parallel rank: ``send_layer`` (from the
forward pass, right after the layer is computed) or ``send_all`` hand this rank's share
of a request's KV to the transport; ``finish(transfer_id, handoff)`` sends the END
(source rank 0's carries the ``Handoff``) and returns once every decode rank answered
that its share landed, or raises a ``KVTransferError``; ``abort`` forgets a transfer.
The source blocks stay untouched until ``finish`` returned. The blocks sent are the
request's table past the ``outside_blocks`` (before a sliding window: nobody reads them)
and the ``cached_blocks`` the destination already holds (``KVDestination.source_blocks``),
the i-th into the destination's ``block_ids[i]``.

Decode side, one ``KVReceiver`` per rank, owning its cache: ``expect`` reserves (the
blocks to write only) and returns the transfer's token (its ``address`` and the token go into the
``KVDestination``); the transfer then lands, fails or expires, reported once to
``on_event``; ``release`` takes it out in any state, after which no byte of it is
written, so the blocks may be freed.

Closed by default (docs/kv_transfer.md), for every backend: both sides take the
cluster's ``secret`` and listen on ``bind`` only (advertising ``advertise``); a sender
proves the secret when it opens a link and names a transfer on the wire by the
destination's token alone; a receiver takes bytes only over proven links, for a
transfer it expects, from the sender ``expect`` named, and bounds every header field
before it allocates anything.

Backends by name (``kv_transfer.backend``): ``gloo``, ``nccl``, ``grpc``, or
``package.module:attribute`` naming a ``Transport`` (the tests' fault injector).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.kv_transfer.layout import KVLayout, KVLayoutError
from pdserve.kv_transfer.protocol import (
    Handoff,
    KVChecksumError,
    KVDestination,
    KVPeerError,
    KVTransferError,
    KVTransferTimeout,
    Status,
)
from pdserve.kv_transfer.routes import HeadRoute, all_routes, routes_from, routes_into

if TYPE_CHECKING:
    from pdserve.kv_transfer.receiver import KVReceiver, Outcome, State
    from pdserve.kv_transfer.sender import Ack, KVSender, TransferAck

# the two ends load on first use (PEP 562): they import torch, which a process that only
# plans transfers (the supervisor, reading an instance's endpoint) does not need
_ENDS = {
    "KVReceiver": "receiver",
    "Outcome": "receiver",
    "State": "receiver",
    "Ack": "sender",
    "KVSender": "sender",
    "TransferAck": "sender",
}


def __getattr__(name: str):
    if name not in _ENDS:
        raise AttributeError(f"module 'pdserve.kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pdserve.kv_transfer.{_ENDS[name]}"), name)


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
            classes.append(getattr(importlib.import_module(f"pdserve.kv_transfer.{module}"), cls))
        return Transport(name, *classes)
    module, _, attr = name.partition(":")
    if not (module and attr):
        raise ValueError(
            f"kv_transfer.backend={name!r} is not one of {list(BACKENDS)} "
            "(or a 'package.module:attribute' naming a Transport)"
        )
    transport = getattr(importlib.import_module(module), attr)
    if not isinstance(transport, Transport):
        raise ValueError(
            f"kv_transfer.backend={name!r} names a {type(transport).__name__}, "
            "not a kv_transfer.Transport"
        )
    return transport


def backend_options(kv_config: dict) -> dict:
    """What a worker's ``kv`` argument gives its backend's sender and receiver beyond the
    options every backend takes: ``tls`` (``kv_transfer.tls``, the grpc backend's mTLS),
    when configured; the config refuses it with another built-in backend."""
    from pdserve.kv_transfer.grpc_tls import from_config

    tls = from_config(kv_config)
    return {} if tls is None else {"tls": tls}


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
    "backend_options",
    "get_transport",
    "routes_from",
    "routes_into",
]
