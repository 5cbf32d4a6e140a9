"""An authenticated rendezvous: a key-value store that only holders of the cluster's
secret can reach (docs/kv_transfer.md, "Rendezvous"). It stands in front of every store
pdserve serves to peers: a decode rank's KV receiver and a tensor-parallel world's
rank 0. torch's ``TCPStore`` server takes any client that connects, and any client may
read, overwrite, delete, pop and grow it; this one takes a request only on a connection
whose client proved the secret and was proved to (``rendezvous.wire``).

The data lives in ``store``, an in-process ``HashStore`` that the serving process uses
directly (its own side of a gloo group is formed on it); remote peers use
``RendezvousStore`` (``rendezvous/client.py``). Invariants and bounds:

- nothing of ``store`` is read or written for a connection before its handshake;
  a handshake ends within ``HANDSHAKE_S`` or the connection is closed, and at most
  ``MAX_PENDING`` run at once (more are closed at once);
- at most ``MAX_PEERS`` authenticated connections; a key is at most ``MAX_KEY`` bytes,
  a value ``MAX_VALUE``; values set by peers total at most ``MAX_TOTAL`` bytes; a
  queue holds at most ``MAX_QUEUE`` values. A request past a bound is answered with
  an error naming the key, its size and the bound, and changes nothing;
- ``refused`` counts connections that did not prove the secret or broke the protocol
  (logged: the first ``LOG_FIRST``, then one in ``LOG_EVERY``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import threading
from typing import Any

from torch.distributed import HashStore

from pdserve.rendezvous.wire import Channel, Op, RendezvousError, Reply, Request, server_handshake

log = logging.getLogger(__name__)
HANDSHAKE_S = 3.0
MAX_PENDING = 64
MAX_PEERS = 256
MAX_KEY = 1024
MAX_VALUE = 64 << 10
MAX_TOTAL = 16 << 20
MAX_QUEUE = 64
MAX_WAIT = datetime.timedelta(hours=1)  # the longest GET or WAIT a peer may ask for
LOG_FIRST, LOG_EVERY = 10, 100  # refusals logged: the first ones, then one in LOG_EVERY


class RendezvousServer:
    """Listens on ``bind:port`` (0: any free port; ``port`` says which) and serves
    ``store`` to authenticated peers until ``close``."""

    def __init__(self, bind: str, port: int, secret: bytes):
        self.secret = secret
        # values are bytes (torch's stubs say str): Any keeps the stubs out of the callers
        self.store: Any = HashStore()
        self.refused = 0
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._peers = threading.BoundedSemaphore(MAX_PEERS)
        self._lock = threading.Lock()
        self._held: dict[bytes, int] = {}  # bytes of each value a peer set
        self._total = 0  # their sum
        self._conns: set[socket.socket] = set()
        self._closed = False
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((bind, port))
            self._sock.listen(128)
        except BaseException:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        self._accept = threading.Thread(target=self._accept_loop, name="rdv-accept", daemon=True)
        self._accept.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if not self._pending.acquire(blocking=False):
                conn.close()  # too many handshakes at once: this one is not started
                with self._lock:
                    self.refused += 1
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="rdv-peer", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = "?"
        admitted = False
        try:
            peer = str(conn.getpeername()[:2])
            conn.settimeout(HANDSHAKE_S)
            try:
                session = server_handshake(conn, self.secret)
            finally:
                self._pending.release()
            if not self._peers.acquire(blocking=False):
                raise RendezvousError(f"{MAX_PEERS} peers are connected already")
            admitted = True
            conn.settimeout(None)  # an authenticated peer may stay idle
            channel = Channel(conn, session, b"s")
            while not self._closed:
                channel.send(self._answer(Request.decode(channel.recv())).encode())
        except (RendezvousError, OSError, ValueError) as e:
            if not admitted and not self._closed:
                with self._lock:
                    self.refused += 1
                    n = self.refused
                if n <= LOG_FIRST or n % LOG_EVERY == 0:  # a flood does not flood the log
                    log.warning(
                        "rendezvous :%d: peer %s refused (%d so far): %s", self.port, peer, n, e
                    )
        finally:
            if admitted:
                self._peers.release()
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _answer(self, req: Request) -> Reply:
        """Run one request against ``store``, within the bounds; refusals are replies."""
        names = req.parts[:1] if req.op in _WRITES else req.parts
        for raw in names:
            if len(raw) > MAX_KEY:
                return Reply(f"a key of {len(raw)} bytes; allowed: up to {MAX_KEY}")
        keys = [k.decode("utf-8", "replace") for k in names]
        store, wait = self.store, min(datetime.timedelta(milliseconds=req.timeout_ms), MAX_WAIT)
        try:
            if req.op == Op.SET:
                key, value = _two(req)
                self._hold(key, value)
                store.set(keys[0], value)
            elif req.op == Op.GET:
                store.wait(keys[:1], wait)
                return Reply(parts=[store.get(keys[0])])
            elif req.op == Op.ADD:
                return Reply(number=store.add(keys[0], req.number))
            elif req.op == Op.WAIT:
                store.wait(keys, wait)
            elif req.op == Op.CHECK:
                return Reply(number=int(store.check(keys)))
            elif req.op == Op.COMPARE_SET:
                key, expected, desired = req.parts
                self._hold(key, desired)
                return Reply(parts=[store.compare_set(keys[0], expected, desired)])
            elif req.op == Op.DELETE:
                with self._lock:
                    self._total -= self._held.pop(req.parts[0], 0)
                return Reply(number=int(store.delete_key(keys[0])))
            elif req.op == Op.NUM_KEYS:
                return Reply(number=store.num_keys())
            elif req.op == Op.QUEUE_PUSH:
                key, value = _two(req)
                if len(value) > MAX_VALUE or store.queue_len(keys[0]) >= MAX_QUEUE:
                    return Reply(
                        f"queue {keys[0][:64]!r} holds {store.queue_len(keys[0])} values, "
                        f"given {len(value)} bytes; allowed: up to {MAX_QUEUE} values "
                        f"of up to {MAX_VALUE} bytes"
                    )
                store.queue_push(keys[0], value)
        except (RendezvousError, ValueError, IndexError) as e:
            return Reply(f"{req.op.name}: {e or 'no key given'}")
        except RuntimeError as e:  # the store's own refusal: a wait that timed out
            return Reply(f"{req.op.name} {keys[:1]}: {e}")
        return Reply()

    def _hold(self, key: bytes, value: bytes) -> None:
        """Count ``value`` against the bounds, or raise a RendezvousError saying which."""
        if len(value) > MAX_VALUE:
            raise RendezvousError(
                f"a value of {len(value)} bytes for {key[:64]!r}; allowed: up to {MAX_VALUE}"
            )
        with self._lock:
            total = self._total - self._held.get(key, 0) + len(value)
            if total > MAX_TOTAL:
                raise RendezvousError(
                    f"setting {key[:64]!r} ({len(value)} bytes) would hold {total} bytes "
                    f"of peers' values; allowed: up to {MAX_TOTAL}"
                )
            self._held[key], self._total = len(value), total

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._accept.join(timeout=5)


_WRITES = (Op.SET, Op.COMPARE_SET, Op.QUEUE_PUSH)  # parts: a key, then values


def _two(req: Request) -> tuple[bytes, bytes]:
    if len(req.parts) != 2:
        raise RendezvousError(f"{req.op.name} takes a key and a value, got {len(req.parts)} parts")
    return req.parts[0], req.parts[1]
