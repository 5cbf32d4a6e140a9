"""The decode pool (``DecodeWorker``: reserve, receive KV, decode), the co-located
instance it builds on (``EngineWorker``), and the other ranks of a tensor-parallel
instance of any role (``RankWorker``)."""

from decode_worker.decode_worker import DecodeWorker
from decode_worker.engine_worker import EngineWorker
from decode_worker.rank_worker import RankWorker

__all__ = ["DecodeWorker", "EngineWorker", "RankWorker"]
