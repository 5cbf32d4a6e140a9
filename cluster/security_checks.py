"""Checks across the security keys of a config (docs/serving.md, "Authentication, TLS
and limits"), run at load with the others, and Ray's TLS environment for the driver.

Closed by default, for the router: the API key file must hold keys, a TLS certificate
comes with its key, and a router bound off loopback authenticates its clients (API keys
or mTLS) unless ``router.insecure: true`` says the network is trusted; so do instances
serving their metrics (a pool's ``metrics_port``) off loopback, with the router's keys.

For an existing Ray (``ray.address`` set): pdserve's router reaches
its instances through Ray's own RPCs, so the Ray it joins must be loopback-only or
authenticated. A Ray off loopback is joined only with Ray's TLS (``ray.tls`` or
``RAY_USE_TLS=1``) or Ray's token authentication (``RAY_AUTH_MODE=token``), unless
``ray.insecure: true`` says the network is trusted (then a warning is logged). The host
of ``ray.address`` is checked at load; ``auto`` names no host, so the address Ray
found is checked right after connecting (``check_connected``), when Ray's own token
mode, on by default for a cluster started by ``ray start`` in Ray 2.60, shows in
``RAY_AUTH_MODE``.
"""

from __future__ import annotations

import ipaddress
import logging
import os

from pdserve.cluster.config import ClusterConfig, RayConfig

log = logging.getLogger(__name__)

_TRUE = ("1", "true")


def check_router(config: ClusterConfig) -> list[tuple[str, str]]:
    """Problems as (dotted key, message); empty when the router's settings hold."""
    from pdserve.router.auth import KeyFileError, read_key_file

    problems = []
    tls = config.router.tls
    if (tls.cert_file is None) != (tls.key_file is None):
        given = "cert_file" if tls.key_file is None else "key_file"
        problems.append(
            (f"router.tls.{given}", "set without its pair; give both cert_file and key_file")
        )
    if tls.client_ca_file is not None and tls.cert_file is None:
        problems.append(
            ("router.tls.client_ca_file", "mTLS needs TLS; set router.tls.cert_file and key_file")
        )
    if config.router.api_key_file is not None:
        try:
            read_key_file(config.router.api_key_file)
        except KeyFileError as e:
            problems.append(("router.api_key_file", str(e).partition(": ")[2]))
    authenticated = config.router.api_key_file is not None or tls.client_ca_file is not None
    if not (is_loopback(config.router.host) or authenticated or config.router.insecure):
        problems.append(
            (
                "router.host",
                f"{config.router.host!r} is not loopback and the router would serve anyone "
                "who reaches it; allowed: set router.api_key_file (API keys) or "
                "router.tls.client_ca_file (mTLS), or router.insecure: true on a trusted network",
            )
        )
    for role, pool in config.pools().items():
        # an instance's metrics port checks the router's API keys (not its mTLS)
        bind = pool.bind or ("127.0.0.1" if config.ray.address is None else None)
        loopback = bind is not None and is_loopback(bind)
        if pool.metrics_port is None or loopback or config.router.api_key_file is not None:
            continue
        if not config.router.insecure:
            where = repr(bind) if bind is not None else "the node's Ray address"
            problems.append(
                (
                    f"{role}.metrics_port",
                    f"the instances would serve their metrics on {where}, not loopback, to "
                    "anyone who reaches it; allowed: set router.api_key_file (scrapes then "
                    "present a key), bind the pool to loopback, or router.insecure: true on "
                    "a trusted network",
                )
            )
    return problems


def check_kv(config: ClusterConfig) -> list[tuple[str, str]]:
    """Problems of ``kv_transfer.tls`` as (dotted key, message): all three files or none,
    and only with a backend that speaks TLS (grpc, or a transport named by module)."""
    kv = config.kv_transfer
    files = {"cert_file": kv.tls.cert_file, "key_file": kv.tls.key_file}
    files["ca_file"] = kv.tls.ca_file
    given = [k for k, v in files.items() if v is not None]
    if not given:
        return []
    if len(given) < len(files):
        missing = next(k for k in files if k not in given)
        return [
            (
                f"kv_transfer.tls.{missing}",
                "missing; the KV plane's mTLS needs cert_file, key_file and ca_file",
            )
        ]
    if kv.backend in ("gloo", "nccl"):
        return [
            (
                "kv_transfer.tls.cert_file",
                f"set with kv_transfer.backend={kv.backend!r}, which has no TLS; allowed: "
                "backend grpc, or no kv_transfer.tls",
            )
        ]
    return []


def check_ray(ray: RayConfig, environ=os.environ) -> list[tuple[str, str]]:
    """Problems of ``ray.tls`` and ``ray.insecure`` as (dotted key, message)."""
    files = {"cert_file": ray.tls.cert_file, "key_file": ray.tls.key_file}
    files["ca_file"] = ray.tls.ca_file
    given = [k for k, v in files.items() if v is not None]
    if given and ray.address is None:
        return [
            (
                f"ray.tls.{given[0]}",
                "set with ray.address null; the embedded Ray runs with token auth, "
                "ray.tls is for an existing Ray",
            )
        ]
    if given and len(given) < len(files):
        missing = next(k for k in files if k not in given)
        return [(f"ray.tls.{missing}", "missing; Ray's TLS needs cert_file, key_file and ca_file")]
    host = address_host(ray.address)
    if host is None or is_loopback(host) or ray.insecure or secured(ray, environ):
        return []
    return [("ray.address", insecure_message(ray.address))]


def insecure_message(address: str) -> str:
    return (
        f"{address!r} is not loopback and Ray's traffic to it would be neither encrypted "
        "nor authenticated; allowed: set ray.tls (or RAY_USE_TLS=1 with Ray's certificate "
        "variables), or RAY_AUTH_MODE=token with the cluster's token, or ray.insecure: true "
        "on a trusted network"
    )


def address_host(address: str | None) -> str | None:
    """The host of ``host:port``, ``ray://host:port`` or ``[v6]:port``; None for no
    address or ``auto`` (no host until Ray finds one)."""
    if address is None or address == "auto":
        return None
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):
        return rest[1:].partition("]")[0]
    return rest.rpartition(":")[0] if ":" in rest else rest


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: not resolved here, so not loopback
        return False


def secured(ray: RayConfig, environ=os.environ) -> bool:
    """Ray's TLS or token authentication is on for this driver."""
    tls = ray.tls.cert_file is not None
    tls = tls or environ.get("RAY_USE_TLS", "0").lower() in _TRUE
    return tls or environ.get("RAY_AUTH_MODE", "").lower() == "token"


def apply_ray_tls(ray: RayConfig, environ=os.environ) -> None:
    """``ray.tls`` into the driver's environment, where Ray reads it, before connecting."""
    tls = ray.tls
    if tls.cert_file is None:
        return
    environ["RAY_USE_TLS"] = "1"
    environ["RAY_TLS_SERVER_CERT"] = os.path.expanduser(tls.cert_file)
    environ["RAY_TLS_SERVER_KEY"] = os.path.expanduser(tls.key_file)
    environ["RAY_TLS_CA_CERT"] = os.path.expanduser(tls.ca_file)


def check_connected(ray: RayConfig, gcs_address: str, environ=os.environ) -> str | None:
    """After joining an existing Ray at ``auto``: the problem when the address it found
    is off loopback and unsecured (unless ``ray.insecure``, which logs a warning
    instead). An address with a host was checked at load: Ray reports its GCS at the
    node's address even when it was reached on loopback, so that host is not asked."""
    if address_host(ray.address) is not None:
        return None
    host = address_host(gcs_address)
    if host is None or is_loopback(host) or secured(ray, environ):
        return None
    if not ray.insecure:
        return insecure_message(gcs_address)
    log.warning(
        "ray.insecure: joined Ray at %s off loopback with neither TLS nor token auth; "
        "anyone on that network can call the cluster's actors",
        gcs_address,
    )
    return None
