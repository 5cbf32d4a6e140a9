"""Connecting to Ray: an embedded local cluster we start and stop, or an existing one.

The embedded cluster is made deterministic for tests and CI: its own temporary
folder (``pdserve-ray-*`` under ``$PDSERVE_RAY_TMPDIR`` or /tmp, removed at the
end), no dashboard, asked for node address 127.0.0.1 (Ray's own daemons still listen
on every interface: docs/serving.md, "The embedded Ray"), and token authentication
with a token made for this process and passed to Ray's processes through the
environment (``RAY_AUTH_TOKEN``), so nothing is read from or written to
``~/.ray``. A ``RAY_AUTH_MODE`` or ``RAY_AUTH_TOKEN`` set by the user wins.

Its workers (the router, the instances, the supervisor) run at the niceness of the
process that starts it, not at Ray's default of 15 (``RAY_worker_niceness=0``, unless
the user set it): they are the service, and at 15 any other process that wakes on the
node, a client, a shell, takes the CPU from an engine step (docs/serving.md, "Worker
niceness").
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import tempfile

from pdserve.cluster.config import RayConfig
from pdserve.cluster.security_checks import apply_ray_tls, check_connected

NAMESPACE = "pdserve"
RAY_WORKER_NICENESS = "RAY_worker_niceness"  # Ray's workers' niceness (its default: 15)


class RaySession:
    def __init__(self, config: RayConfig):
        self.config = config
        self.temp_dir: str | None = None
        self.owned = False  # we called ray.init, so we call ray.shutdown

    @property
    def embedded(self) -> bool:
        return self.config.address is None

    def start(self) -> None:
        import ray

        if ray.is_initialized():
            return  # the caller's own Ray session: use it, leave it running
        kwargs = dict(
            namespace=NAMESPACE,
            log_to_driver=True,
            logging_level=logging.WARNING,
        )
        if self.embedded:
            _embedded_auth()
            os.environ.setdefault(RAY_WORKER_NICENESS, "0")
            self.temp_dir = tempfile.mkdtemp(prefix="pdserve-ray-", dir=temp_base())
            cpus = self.config.num_cpus or os.cpu_count() or 1
            kwargs.update(
                num_cpus=math.ceil(cpus),
                include_dashboard=False,
                _temp_dir=self.temp_dir,
                _node_ip_address="127.0.0.1",
                object_store_memory=256 * 1024**2,
            )
        else:
            apply_ray_tls(self.config)
            kwargs["address"] = self.config.address
        try:
            ray.init(**kwargs)
        except Exception:
            self._remove_temp_dir()
            raise
        self.owned = True
        if not self.embedded:
            self._check_joined(ray.get_runtime_context().gcs_address)

    def _check_joined(self, gcs_address: str) -> None:
        """Leave a Ray that is off loopback and unsecured (cluster/security_checks.py)."""
        from pdserve.cluster.config_loader import ConfigError

        problem = check_connected(self.config, gcs_address)
        if problem is not None:
            self.stop()
            raise ConfigError("ray.address", problem)

    def stop(self) -> None:
        if self.owned:
            import ray

            ray.shutdown()
            self.owned = False
        self._remove_temp_dir()

    def _remove_temp_dir(self) -> None:
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def temp_base() -> str | None:
    """Where embedded Ray folders go: ``$PDSERVE_RAY_TMPDIR``, else /tmp (Ray's socket
    paths must stay short)."""
    base = os.environ.get("PDSERVE_RAY_TMPDIR")
    if base:
        return base
    return "/tmp" if os.path.isdir("/tmp") else None


def _embedded_auth() -> None:
    """Token auth with a per-process token, unless the user chose a mode.

    With ``RAY_AUTH_MODE`` unset, ``ray.init`` of a new local cluster turns token
    mode on itself; it then finds the token in ``RAY_AUTH_TOKEN`` and writes no file.
    """
    if os.environ.get("RAY_AUTH_MODE", "token") == "token":
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    # Ray warns on every start that it enabled token auth by default; we chose it.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
        logging.ERROR
    )
