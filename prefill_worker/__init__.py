"""The prefill pool: chunked prefill, first token, KV sent to the decode pool
(``PrefillWorker``; ``PrefillRank`` for ranks 1..N-1 of a tensor-parallel instance)."""

from prefill_worker.prefill_rank import PrefillRank
from prefill_worker.prefill_worker import PrefillWorker

__all__ = ["PrefillRank", "PrefillWorker"]
