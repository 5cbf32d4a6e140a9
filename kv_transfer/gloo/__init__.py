"""torch.distributed point-to-point backends: ``gloo`` (CPU tensors) and ``nccl`` (CUDA).

Groups: no cluster-wide world. Each receiver (decode rank) runs a ``TCPStore`` server;
its address ``host:port`` is what senders are given. A sender that first talks to a
receiver connects to that store, reads the receiver's layout, pushes a join request
``{name, rank, gen, layout}`` onto the store's ``kv/joins`` queue and builds a two-rank
group on ``PrefixStore("pair/<name>/<rank>/<gen>", store)`` (sender rank 0, receiver
rank 1); the receiver's accept thread pops the request and builds its side. A restarted
sender joins again under a new ``gen``, which replaces the receiver's old pair; a sender
whose receiver restarted or died finds out on its next transfer and joins afresh.

Modules: ``wire`` (tags and the int64 header), ``group`` (group types, store keys),
``batches`` (which segments a sender packs), ``sender``, ``receiver`` and ``reader``
(one pair on the receiving side). The protocol is in docs/kv_transfer.md.
"""

from kv_transfer.gloo.receiver import GlooReceiver, NcclReceiver
from kv_transfer.gloo.sender import GlooSender, NcclSender

__all__ = ["GlooReceiver", "GlooSender", "NcclReceiver", "NcclSender"]
