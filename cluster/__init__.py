"""Launching pdserve: configuration, Ray placement, health, and the ``pdserve`` command.

``cluster.launch(config)`` starts a cluster and returns its ``Cluster`` handle;
``cluster.load_config(path, overrides)`` reads and checks a YAML config. Imported
lazily, so that the client side of the CLI does not load torch.
"""

from __future__ import annotations

_EXPORTS = {
    "launch": "pdserve.cluster.launcher",
    "Cluster": "pdserve.cluster.launcher",
    "load_config": "pdserve.cluster.config_loader",
    "ConfigError": "pdserve.cluster.config_loader",
    "ClusterConfig": "pdserve.cluster.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
