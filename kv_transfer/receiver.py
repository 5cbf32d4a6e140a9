"""``KVReceiver``: the decode side every backend shares; the bookkeeping is the
``TransferBook``, a backend adds its ``address`` and the transport that feeds the book."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from kv_transfer.book import TransferBook
from kv_transfer.layout import KVLayout
from kv_transfer.pending import TransferStats


class KVReceiver(ABC):
    """Decode side of one tensor-parallel rank (the contract: ``kv_transfer/base.py``)."""

    backend = ""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor):
        self.layout = layout
        self.book = TransferBook(layout, kv_cache)

    @property
    @abstractmethod
    def address(self) -> str: ...

    def expect(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        src_layout: KVLayout,
        lease_s: float | None = None,
    ) -> None:
        """Register a transfer before it can arrive: its blocks ``dst_block_ids`` (in the
        order of the source's block list) and the source pool's layout."""
        self.book.expect(transfer_id, dst_block_ids, src_layout, lease_s)

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferStats:
        return self.book.wait(transfer_id, timeout)

    def ready(self, transfer_id: str) -> bool:
        return self.book.ready(transfer_id)

    def cancel(self, transfer_id: str) -> bool:
        return self.book.cancel(transfer_id)

    def reap_expired(self) -> list[str]:
        return self.book.reap_expired()

    def pending(self) -> list[str]:
        return self.book.pending()

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
