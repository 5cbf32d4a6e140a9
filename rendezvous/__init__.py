"""The authenticated rendezvous (docs/kv_transfer.md, "Rendezvous"): a key-value store
that only peers proving the cluster's secret, and proved to, reach; served to torch's
process groups as a ``torch.distributed.Store``. A library of its own because two
folders form process groups on it and neither may import the other: engine/parallel.py
(a tensor-parallel world) and kv_transfer/ (the gloo KV plane's pairs). It imports
nothing of ours. ``server`` holds the store and its listener, ``client`` the peers'
``RendezvousStore``, ``wire`` the handshake and the framed requests."""
