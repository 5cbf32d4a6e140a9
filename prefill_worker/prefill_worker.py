"""The prefill instance: a Ray actor that prefills prompts and hands them to decode. Its
side of the handoff (docs/kv_transfer.md) is ``kv_transfer.prefill_side``: every request
it takes is a hand-off request (engine/prefilled.py), prefilled in chunks FCFS with
other prompts under the token budget, its KV sent to the decode instance's reservation
(``attempt.destination``) and its first token carried by the transfer's END:

    prefill(attempt) -> [sending] -> every rank heard every END answered OK: blocks
                        freed, Update(handed_off)                        [acked]
                     -> a refusal, a broken link or no answer within the ack timeout:
                        blocks freed, Update(retryable); the router redoes the request
                        on another pair                                  [failed]

Ranks 1..N-1 (``PrefillRank``) send their heads and push their own outcome here.
"""

from __future__ import annotations

from instance.inbox import Acked, Prefill
from instance.messages import Update
from instance.worker import EngineWorker
from kv_transfer.layout import cache_layout
from kv_transfer.prefill_side import PrefillsForOthers, PrefillSide


class PrefillWorker(PrefillsForOthers, EngineWorker):
    """Every request it takes hands off: its engine never decodes."""

    role = "prefill"

    def _setup(self, kv_config: dict) -> None:
        self.layout = cache_layout(self.engine)
        self.side = PrefillSide(
            self.name, self.engine, self.layout, kv_config, len(self.ranks), self._post
        )
        self._ops.update({Prefill: self._op_prefill, Acked: self._op_acked})
        self._totals["kv_bytes_total"] = 0

    def ready(self) -> dict:
        return {**super().ready(), "kv_tp_size": self.layout.tp_size}

    def rank_acked(self, transfer_id: str, rank: int, nbytes: int, error: str | None) -> None:
        """Rank ``rank``'s ENDs of a transfer were answered (or failed): pushed by it."""
        self._post(Acked(transfer_id, rank, nbytes, 0.0, error))

    def stop(self) -> None:
        super().stop()
        self.side.close()

    # ---- on the step loop ----

    def _owns(self, request_id: str) -> bool:
        return self.side.owns(request_id)

    def _abort(self, request_id: str) -> list[Update]:
        self.side.abort(request_id)
        return []

    def _stats(self) -> dict:
        stats = super()._stats()
        stats["in_transfer"] = self.side.in_transfer
        return stats
