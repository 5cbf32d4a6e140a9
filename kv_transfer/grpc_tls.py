"""mTLS on the grpc backend (``kv_transfer.tls``; docs/kv_transfer.md, "Closed by
default"): the credentials both ends build from the same three PEM files, read on the
node each worker runs on. No wire format here.

Invariants: with ``tls`` given, a receiver listens with TLS only and requires a client
certificate that chains to ``ca_file``; a sender presents ``cert_file`` and trusts only
receivers whose certificate chains to ``ca_file`` and names the host it dials (so the
certificate must name every pool's ``advertise`` address); without ``tls`` both speak
plain text. TLS adds to the secret's proofs (``grpc_gate.py``), it does not replace them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    """``kv_transfer.tls``: this worker's certificate chain and key, and the CA its peers'
    certificates must chain to."""

    cert_file: str
    key_file: str
    ca_file: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(key, certificate chain, CA) as bytes; ValueError naming an unreadable file."""
        out = []
        for key in ("key_file", "cert_file", "ca_file"):
            path = getattr(self, key)
            try:
                out.append(Path(path).expanduser().read_bytes())
            except OSError as e:
                raise ValueError(
                    f"kv_transfer.tls.{key}={path!r}: cannot read it ({e.strerror})"
                ) from e
        return out[0], out[1], out[2]

    def server(self) -> grpc.ServerCredentials:
        key, cert, ca = self.read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel(self) -> grpc.ChannelCredentials:
        key, cert, ca = self.read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )


def from_config(kv_config: dict) -> TLSFiles | None:
    """The ``tls`` section of a worker's ``kv`` argument (None: not configured)."""
    tls = kv_config.get("tls") or {}
    return TLSFiles(**tls) if tls.get("cert_file") is not None else None
