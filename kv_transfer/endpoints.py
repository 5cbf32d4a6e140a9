"""Where a worker's KV endpoints stand: its cache's layout and the host they listen on."""

from __future__ import annotations

import os

from kv_transfer.layout import KVLayout, dtype_name


def cache_layout(model, blocks) -> KVLayout:
    """The ``KVLayout`` of one rank's cache, from the engine's model shard
    (``engine.model.LlamaModel``: its config, dtype and tensor-parallel place) and its
    block manager (block size)."""
    cfg = model.cfg
    return KVLayout(
        num_layers=cfg.num_layers,
        block_size=blocks.block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype_name(model.dtype),
        tp_size=model.tp.size,
        tp_rank=model.tp.rank,
    )


def kv_host() -> str:
    """The address this worker's KV endpoints use: ``PDSERVE_KV_HOST``, else Ray's node IP."""
    if "PDSERVE_KV_HOST" in os.environ:
        return os.environ["PDSERVE_KV_HOST"]
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
