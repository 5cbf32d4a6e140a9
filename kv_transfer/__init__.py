"""KV cache transfer between the prefill and decode pools (docs/kv_transfer.md).

One interface (``KVSender`` / ``KVReceiver``, the contract in ``base``), backends picked
by name with ``get_transport("gloo" | "nccl" | "grpc")``, the block and KV-head mapping
between pools (``blocks``, ``head_map``), and the handoff type that travels between them.
"""

from kv_transfer.base import (
    BACKENDS,
    Ack,
    KVReceiver,
    KVSender,
    TransferAck,
    Transport,
    get_transport,
)
from kv_transfer.errors import (
    KVChecksumError,
    KVLayoutError,
    KVPeerError,
    KVTransferError,
    KVTransferTimeout,
)
from kv_transfer.handoff import KVDestination, KVHandoff, transfer_id_for
from kv_transfer.head_map import HeadRoute, all_routes, routes_from, routes_into
from kv_transfer.layout import KVLayout
from kv_transfer.pending import Status, TransferStats

__all__ = [
    "BACKENDS",
    "Ack",
    "HeadRoute",
    "KVChecksumError",
    "KVDestination",
    "KVHandoff",
    "KVLayout",
    "KVLayoutError",
    "KVPeerError",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "KVTransferTimeout",
    "Status",
    "TransferAck",
    "TransferStats",
    "Transport",
    "all_routes",
    "get_transport",
    "routes_from",
    "routes_into",
    "transfer_id_for",
]
