"""What both pools need to talk KV: their cache's layout and the host to listen on."""

from __future__ import annotations

import os

from engine.llm_engine import LLMEngine
from kv_transfer.layout import KVLayout, dtype_name


def cache_layout(engine: LLMEngine) -> KVLayout:
    """The ``KVLayout`` of ``engine``'s cache (one rank: pools run one rank for now)."""
    cfg, blocks = engine.model_config, engine.blocks
    return KVLayout(
        num_layers=cfg.num_layers,
        block_size=blocks.block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype_name(engine.model.dtype),
    )


def kv_host() -> str:
    """The address this worker's KV endpoints use: ``PDSERVE_KV_HOST``, else Ray's node IP."""
    if "PDSERVE_KV_HOST" in os.environ:
        return os.environ["PDSERVE_KV_HOST"]
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
