"""Rank r > 0 of a tensor-parallel decode instance: the KV receiver of its share of the
heads. Rank 0 (``DecodeWorker``) calls ``expect`` when it reserves blocks, ``collect``
to learn which transfers have landed here, and ``cancel``."""

from __future__ import annotations

from dataclasses import replace

from engine.tp_rank import RankActor
from kv_transfer import KVTransferError, get_transport
from kv_transfer.endpoints import cache_layout, kv_host


class DecodeRank(RankActor):
    def _setup(self, kv_config: dict) -> None:
        self.layout = cache_layout(self.engine.model, self.engine.runner.blocks)
        self.receiver = get_transport(kv_config["backend"]).receiver(
            self.layout, self.engine.runner.kv_cache, host=kv_host()
        )

    def ready(self) -> dict:
        return {**super().ready(), "kv_address": self.receiver.address}

    def expect(self, transfer_id: str, block_ids: list[int], src_tp: int, lease_s: float):
        src = replace(self.layout, tp_size=src_tp, tp_rank=0)
        self.receiver.expect(transfer_id, block_ids, src, lease_s)

    def collect(self, transfer_ids: list[str]) -> dict[str, tuple[int, str]]:
        """The transfers that have landed (or failed) on this rank: (bytes, error)."""
        out = {}
        for tid in transfer_ids:
            if tid in self.receiver.pending() and self.receiver.ready(tid):
                try:
                    out[tid] = (self.receiver.wait(tid, timeout=0).bytes, "")
                except KVTransferError as e:
                    out[tid] = (0, f"{self.name}: {e}")
        return out

    def cancel(self, transfer_ids: list[str]) -> None:
        for tid in transfer_ids:
            self.receiver.cancel(tid)
