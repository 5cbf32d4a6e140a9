"""The decode pool: ``DecodeWorker`` (reserve blocks, receive KV, decode) and, for a
tensor-parallel instance, ``DecodeRank`` (ranks 1..N-1: their share of the KV)."""

from decode_worker.decode_rank import DecodeRank
from decode_worker.decode_worker import DecodeWorker

__all__ = ["DecodeRank", "DecodeWorker"]
