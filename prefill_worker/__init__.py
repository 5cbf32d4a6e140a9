"""The prefill pool: chunked prefill, first token, KV sent to the decode pool."""

from prefill_worker.prefill_engine import Prefilled, PrefillEngine
from prefill_worker.prefill_worker import PrefillWorker

__all__ = ["PrefillEngine", "PrefillWorker", "Prefilled"]
