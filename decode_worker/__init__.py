"""The decode pool (``DecodeWorker``: reserve, receive KV, decode) and the co-located
instance it builds on (``EngineWorker``)."""

from decode_worker.decode_worker import DecodeWorker
from decode_worker.engine_worker import EngineWorker

__all__ = ["DecodeWorker", "EngineWorker"]
