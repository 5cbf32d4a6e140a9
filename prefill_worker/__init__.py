"""The prefill pool's parts: the sending component of its workers (``Sending``: chunked
prefill, first token, KV sent to the decode pool) and ``PrefillRank`` for ranks 1..N-1 of
a tensor-parallel instance."""

from pdserve.prefill_worker.prefill_rank import PrefillRank
from pdserve.prefill_worker.sending import Sending

__all__ = ["PrefillRank", "Sending"]
