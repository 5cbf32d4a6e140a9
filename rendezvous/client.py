"""A ``torch.distributed.Store`` over an authenticated rendezvous (``rendezvous/server.py``):
what a peer hands torch's process groups in place of a ``TCPStore`` client.

The connection is made, and both sides proved the cluster's secret, before the object
exists: a listener that does not prove it is refused within ``connect_s``
(``RendezvousError``, or ``OSError`` when nothing listens). One request is in flight
at a time (a lock); GET and WAIT wait for their keys up to the store's ``timeout``, the
socket a little longer. A connection that breaks stays broken: every later request
raises, and the owner makes a new store.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time

import torch.distributed as dist

from pdserve.rendezvous.wire import (
    Channel,
    Op,
    RendezvousBusy,
    RendezvousError,
    Reply,
    Request,
    client_handshake,
)

SLACK_S = 5.0  # the socket waits this much past a request's own timeout
RETRY_S = 0.05  # between tries of a handshake cut short


def _raw(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _connect(host: str, port: int, secret: bytes, seconds: float) -> Channel:
    """An authenticated channel within ``seconds``. A refused connection (nothing
    listens) fails at once; a handshake cut short is tried again until the deadline,
    since a server busy with ``MAX_PENDING`` handshakes closes new connections at once
    (an outsider holding them open is cut off after ``HANDSHAKE_S``)."""
    deadline = time.monotonic() + seconds
    while True:
        sock = socket.create_connection(
            (host, port), timeout=max(0.05, deadline - time.monotonic())
        )
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return Channel(sock, client_handshake(sock, secret, deadline), b"c")
        except RendezvousBusy as e:
            sock.close()
            if time.monotonic() + RETRY_S >= deadline:
                raise RendezvousError(f"rendezvous {host}:{port}: {e}") from e
            time.sleep(RETRY_S)
        except (OSError, RendezvousError) as e:
            sock.close()
            raise RendezvousError(f"rendezvous {host}:{port}: {e}") from e


class RendezvousStore(dist.Store):
    """A client of the rendezvous at ``host:port`` that holds ``secret``."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        timeout: datetime.timedelta,
        connect_s: float = 5.0,
    ):
        super().__init__()
        self.set_timeout(timeout)
        self.address = f"{host}:{port}"
        self._lock = threading.Lock()
        self._channel = _connect(host, port, secret, connect_s)
        self._broken: Exception | None = None

    def _call(self, req: Request) -> Reply:
        waits = req.op in (Op.GET, Op.WAIT)
        if waits and not req.timeout_ms:
            req.timeout_ms = int(self.timeout.total_seconds() * 1000)
        with self._lock:
            if self._broken is not None:
                raise RendezvousError(f"rendezvous {self.address}: broken ({self._broken})")
            sock = self._channel.sock
            sock.settimeout(req.timeout_ms / 1000 + SLACK_S if waits else SLACK_S)
            try:
                self._channel.send(req.encode())
                reply = Reply.decode(self._channel.recv())
            except (OSError, RendezvousError) as e:
                self._broken = e
                sock.close()
                raise RendezvousError(f"rendezvous {self.address}: {e}") from e
        if reply.error:
            raise RendezvousError(f"rendezvous {self.address}: {reply.error}")
        return reply

    def set(self, key, value) -> None:
        self._call(Request(Op.SET, [_raw(key), _raw(value)]))

    def get(self, key) -> bytes:
        return self._call(Request(Op.GET, [_raw(key)])).parts[0]

    def add(self, key, value: int) -> int:
        return self._call(Request(Op.ADD, [_raw(key)], number=value)).number

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        ms = 0 if timeout is None else max(1, int(timeout.total_seconds() * 1000))
        self._call(Request(Op.WAIT, [_raw(k) for k in keys], timeout_ms=ms))

    def check(self, keys) -> bool:
        return bool(self._call(Request(Op.CHECK, [_raw(k) for k in keys])).number)

    def compare_set(self, key, expected, desired) -> bytes:
        req = Request(Op.COMPARE_SET, [_raw(key), _raw(expected), _raw(desired)])
        return self._call(req).parts[0]

    def delete_key(self, key) -> bool:
        return bool(self._call(Request(Op.DELETE, [_raw(key)])).number)

    def num_keys(self) -> int:
        return self._call(Request(Op.NUM_KEYS)).number

    def queue_push(self, key, value) -> None:
        self._call(Request(Op.QUEUE_PUSH, [_raw(key), _raw(value)]))

    def close(self) -> None:
        with self._lock:
            self._broken = self._broken or RendezvousError("closed")
            self._channel.sock.close()
