"""The errors KV transfer raises; each message names the transfer and what went wrong."""

from __future__ import annotations

from kv_transfer.layout import KVLayoutError


class KVTransferError(RuntimeError):
    """A transfer failed: the peer is gone, refused it, or the data did not arrive intact."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A transfer did not complete within its lease (or the given timeout)."""


class KVChecksumError(KVTransferError):
    """A chunk's bytes differ from what the sender summed: the transfer is dropped."""


class KVPeerError(KVTransferError):
    """The connection to the other side failed or was lost."""


__all__ = [
    "KVChecksumError",
    "KVLayoutError",
    "KVPeerError",
    "KVTransferError",
    "KVTransferTimeout",
]
