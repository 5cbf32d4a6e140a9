"""The decode pool's parts: the receiving component of its workers (``Receiving``:
reserve blocks, receive KV; the worker's engine decodes) and, for a tensor-parallel
instance, ``DecodeRank`` (ranks 1..N-1: their share of the KV)."""

from pdserve.decode_worker.decode_rank import DecodeRank
from pdserve.decode_worker.receiving import Receiving

__all__ = ["DecodeRank", "Receiving"]
