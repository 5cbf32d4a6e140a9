"""TLS on the router's ports (``router.tls``; docs/serving.md, "Authentication, TLS and
limits"): the PEM files the gRPC server's credentials are made of (router/grpc_api.py)
and the HTTP server's ``ssl.SSLContext``, from the same files; no wire format here.

Invariants: with ``cert_file`` set both ports speak TLS only (a plain-text connection
fails its handshake); TLS 1.2 at least; with ``client_ca_file`` set a client must present
a certificate that chains to it (mTLS) on both ports.
"""

from __future__ import annotations

import ssl
from pathlib import Path


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"router.tls.{key}={path!r}: cannot read it ({e.strerror})") from e


def enabled(tls: dict) -> bool:
    return tls.get("cert_file") is not None


def pem_files(tls: dict) -> tuple[bytes, bytes, bytes | None]:
    """The private key, the certificate chain and the client CAs (None: no mTLS) as
    bytes, for the gRPC server's credentials (``tls``: the ``router.tls`` section)."""
    client_ca = tls.get("client_ca_file")
    return (
        _read(tls["key_file"], "key_file"),
        _read(tls["cert_file"], "cert_file"),
        _read(client_ca, "client_ca_file") if client_ca else None,
    )


def ssl_context(tls: dict) -> ssl.SSLContext:
    """The HTTP server's context (``tls``: the ``router.tls`` section)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(Path(tls["cert_file"]).expanduser(), Path(tls["key_file"]).expanduser())
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"router.tls.cert_file={tls['cert_file']!r}, key_file={tls['key_file']!r}: "
            f"not a certificate chain and its private key ({e})"
        ) from e
    if tls.get("client_ca_file"):
        ctx.load_verify_locations(cafile=str(Path(tls["client_ca_file"]).expanduser()))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
