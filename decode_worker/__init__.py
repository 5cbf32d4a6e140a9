"""The decode side of the cluster; for now the co-located engine worker (``EngineWorker``)."""

from decode_worker.engine_worker import EngineWorker

__all__ = ["EngineWorker"]
