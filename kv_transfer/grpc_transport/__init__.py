"""The ``grpc`` backend: a streaming RPC carrying raw tensor bytes with protobuf metadata.

Works between any two hosts that reach each other over TCP, with no process group.
The decode rank runs a ``KVTransfer`` server; a prefill rank opens one ``Push`` stream
per (transfer, decode rank) on the first segment, feeds it chunks as layers are computed
(``send_layer`` only queues them; gRPC's thread writes them out), and closes it in
``finish``, which returns the server's ``PushAck``.

A chunk is K or V of a run of blocks for one layer and head range, at most
``chunk_bytes`` of data (whole blocks), under the message limits that both ends raise
explicitly (``MAX_MESSAGE``). The wire form is an ordinary ``KVChunk`` message written
with the metadata first and the data last, so neither end copies the data more than
once: the sender joins metadata and tensor memory into the message bytes, the receiver
copies from the message bytes into its cache.
"""

from kv_transfer.grpc_transport.receiver import GrpcReceiver
from kv_transfer.grpc_transport.sender import GrpcSender

__all__ = ["GrpcReceiver", "GrpcSender"]
