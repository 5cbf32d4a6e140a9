"""An instance's update feed: what ``EngineWorker.poll`` answers, pushed down one TCP
connection per consumer instead of fetched with one Ray call per engine step
(docs/serving.md, "The update feed").

Why: answering a Ray actor call costs the instance's process more than the call's own
work (Ray's main thread receives it, a thread of the actor's pool runs it, the answer
is serialised), and that CPU is taken from the step's threads once per step. A frame
written to a socket by a thread that waits on the same condition ``poll`` waits on
costs a small fraction of it.

Rendezvous and trust (closed by default): the consumer asks the instance through Ray
(``EngineWorker.open_feed``, over Ray's own authenticated calls) and gets a
``FeedTicket``: the listener's address (the pool's KV interface, 127.0.0.1 on an
embedded Ray) and a one-time token of 128 random bits. It connects and sends the token
first. A connection whose first ``TOKEN_CHARS`` bytes are not a live token within
``HANDSHAKE_S`` is closed having been sent nothing; a token is good for one connection
within ``TICKET_TTL_S``; at most ``MAX_HANDSHAKES`` connections wait for their token at
once (more are closed at once). The frames themselves are neither signed nor
encrypted, as the KV plane's bulk bytes are not (docs/kv_transfer.md).

Wire, after the token: frames, each a 4-byte little-endian length and a msgpack map
(no pickle). Instance to consumer (``encode``/``decode``), one ``Polled`` each: the
consumer's updates since the previous frame, the instance's stats, and (when the
ticket carried a ``CacheCursor``) the prefix cache's changes since the previous
frame's cursor, and the answers to its ``reserve``s; one goes out as soon as there is
news, and at least every ``HEARTBEAT_S``. Consumer to instance
(``encode_command``/``decode_command``), one command each: ``add`` (an ``Attempt``),
``prefill`` (an ``Attempt`` with its ``destination``, to an instance that prefills for
others: prefill_worker/sending.py), ``reserve`` (an ``Attempt``, to a decode
instance, decode_worker/receiving.py: its ``Reserved`` answer comes down the feed) or
``abort`` (attempt ids), applied in the order sent, by what the worker and its
components (instance/component.py) apply them with (what a Ray
call per request cost both processes, a frame does not); a frame naming anything else,
or a command this instance does not take, ends the connection.

Lifecycle: the connection lasts as long as the instance; its end (EOF, reset) tells
the consumer the instance is gone. Its sender thread ends when the server closes (the
instance stops) or a send fails (the consumer went away). A consumer whose connection
ends while the instance runs has left: the server calls ``left`` with its name, and the
worker keeps its requests running and their updates accumulating for
``router.rejoin_grace_s``, then drops them, freeing their blocks, and its outbox (grace
0: at once). Invariant: one connection per consumer name; two would split one outbox
between them: a new connection under a name that has one supersedes it (the old one
is shut and its sender gone before the new one's first frame, and ``left`` is called
for it before ``joined``: left and back at once).

Rejoining: the first frame of every connection carries ``Polled.live``, what
``joined(consumer)`` answers (``EngineWorker.consumer_joined``): every attempt the
instance still holds for that name (``LiveAttempt``: the attempt as sent, what it
produced so far, how it ended), taken at one instant with the outbox emptied, so that
this and later frames carry exactly the updates that follow. A restarted router (the
same consumer name) rebuilds its streams from it (router/rebuild.py).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, fields
from typing import Any

import msgpack

from pdserve.engine.outputs import Logprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.instance.messages import (
    Attempt,
    CacheCursor,
    CacheDelta,
    LiveAttempt,
    Polled,
    Reserved,
    Update,
)

log = logging.getLogger(__name__)

TOKEN_CHARS = 32  # secrets.token_hex(16)
HANDSHAKE_S = 5.0
TICKET_TTL_S = 60.0
MAX_HANDSHAKES = 8
HEARTBEAT_S = 0.5
SEND_TIMEOUT_S = 60.0  # a consumer that takes nothing this long is gone
LENGTH = struct.Struct("<I")
MAX_FRAME = 1 << 28  # bytes; a longer length prefix is a broken stream


@dataclass(frozen=True)
class FeedTicket:
    """``address``: host:port of the instance's feed listener; ``token``: what the
    consumer sends first (good once, for ``TICKET_TTL_S``)."""

    address: str
    token: str

    def endpoint(self) -> tuple[str, int]:
        """(host, port) to connect to: ``address`` split, an IPv6 host without brackets."""
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)


# ---- the frames ----

COMMANDS = ("add", "prefill", "reserve", "abort")
ATTEMPT_COMMANDS = ("add", "prefill", "reserve")  # their value: an ``Attempt``

# every field of an update but its id, at its default (a field the frame leaves out)
_UPDATE_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if f.default is MISSING else f.default  # type: ignore[operator]
    for f in fields(Update)
    if f.name != "request_id"
}


def encode(polled: Polled) -> bytes:
    """One frame: the length prefix and the msgpack body of ``polled``."""
    body = msgpack.packb(
        {
            "updates": [_pack_update(u) for u in polled.updates],
            "stats": polled.stats,
            "cache": None if polled.cache is None else polled.cache.__dict__,
            "reserved": [r.__dict__ for r in polled.reserved],
            "live": None if polled.live is None else [_pack_live(a) for a in polled.live],
        },
        use_bin_type=True,
    )
    return LENGTH.pack(len(body)) + body


def decode(body: bytes) -> Polled:
    """``Polled`` from a frame's body (the bytes after its length prefix)."""
    d = msgpack.unpackb(body, raw=False, strict_map_key=False)
    cache = d["cache"]
    return Polled(
        [_unpack_update(u) for u in d["updates"]],
        d["stats"],
        None if cache is None else CacheDelta(**cache),
        [Reserved(**r) for r in d["reserved"]],
        None if d["live"] is None else [_unpack_live(a) for a in d["live"]],
    )


def encode_command(kind: str, value: Attempt | list[str]) -> bytes:
    """One consumer-to-instance frame: ``add``, ``prefill`` or ``reserve`` an ``Attempt``,
    or ``abort`` attempt ids."""
    payload: Attempt | list[str] | dict = value
    if kind in ATTEMPT_COMMANDS:
        assert isinstance(value, Attempt)  # these kinds' value (the docstring)
        payload = _pack_attempt(value)
    body = msgpack.packb({kind: payload}, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def decode_command(body: bytes) -> tuple[str, Attempt | list[str]]:
    """(kind, value) of a command frame's body; ValueError for anything but one of
    ``COMMANDS``."""
    d = msgpack.unpackb(body, raw=False)
    if not isinstance(d, dict) or len(d) != 1 or next(iter(d)) not in COMMANDS:
        raise ValueError(f"feed command {str(d)[:80]!r}: must be one of {COMMANDS}")
    [(kind, value)] = d.items()
    if kind in ATTEMPT_COMMANDS:
        value = _unpack_attempt(value)
    return kind, value


def _pack_attempt(a: Attempt) -> dict:
    return {**a.__dict__, "params": a.params.as_dict()}


def _unpack_attempt(d: dict) -> Attempt:
    d["params"] = SamplingParams(**d["params"])
    d["prompt_ids"] = tuple(d["prompt_ids"])
    d["delivered"] = tuple(d["delivered"])
    d["choices"] = tuple(d.get("choices", ()))
    return Attempt(**d)


def _pack_live(a: LiveAttempt) -> dict:
    return {**a.__dict__, "attempt": _pack_attempt(a.attempt)}


def _unpack_live(d: dict) -> LiveAttempt:
    d["attempt"] = _unpack_attempt(d["attempt"])
    return LiveAttempt(**d)


def cut(buf: bytearray) -> list[bytes]:
    """The bodies of the whole frames at the head of ``buf``, removed from it;
    ValueError for a length past ``MAX_FRAME`` (a broken stream)."""
    out, at = [], 0
    while len(buf) - at >= LENGTH.size:
        (size,) = LENGTH.unpack_from(buf, at)
        if size > MAX_FRAME:
            raise ValueError(f"a feed frame of {size} bytes (at most {MAX_FRAME})")
        if len(buf) - at - LENGTH.size < size:
            break
        out.append(bytes(buf[at + LENGTH.size : at + LENGTH.size + size]))
        at += LENGTH.size + size
    del buf[:at]
    return out


def frames(conn: socket.socket) -> Iterator[Polled]:
    """Each frame a connected blocking socket receives, decoded, until the connection
    ends: a consumer without an event loop (benchmarks, tests); the router's is
    router/instances.py."""
    buf = bytearray()
    while chunk := conn.recv(1 << 16):
        buf += chunk
        for body in cut(buf):
            yield decode(body)


def _pack_update(u: Update) -> dict:
    # the fields that differ from their defaults (most updates: an id and a few tokens)
    out = {k: v for k, v in u.__dict__.items() if k == "request_id" or v != _UPDATE_DEFAULTS[k]}
    for key in ("logprobs", "prompt_logprobs"):
        if (lps := getattr(u, key)) is not None:
            out[key] = [
                None if p is None else [p.token_id, p.logprob, p.top_ids, p.top_logprobs, p.rank]
                for p in lps
            ]
    return out


def _unpack_update(d: dict) -> Update:
    for key in ("logprobs", "prompt_logprobs"):
        if (lps := d.get(key)) is not None:
            d[key] = [
                None if p is None else Logprobs(p[0], p[1], tuple(p[2]), tuple(p[3]), p[4])
                for p in lps
            ]
    return Update(**d)


# ---- the instance's side ----


class FeedServer:
    """Listens on ``bind`` (any free port) for consumers holding a ticket; feeds each
    what ``poll(consumer, timeout_s, cursor)`` answers (``EngineWorker.poll``)."""

    def __init__(
        self,
        name: str,
        poll: Callable[[str, float, CacheCursor | None], Polled],
        commands: dict[str, Callable],
        bind: str,
        advertise: str,
        left: Callable[[str], None] = lambda consumer: None,
        joined: Callable[[str], list[LiveAttempt]] = lambda consumer: [],
    ):
        """``commands``: what applies each of ``COMMANDS`` this instance takes (the
        methods its worker's ``feed_commands`` name); ``left``:
        called with a consumer's name when its connection ends before the server closes
        (the worker's ``consumer_left``); ``joined``: called with it as a connection
        starts, its answer the first frame's ``live`` (the worker's
        ``consumer_joined``)."""
        self._poll, self._commands = poll, commands
        self._left, self._joined = left, joined
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._listener = socket.create_server((bind, 0), family=family, backlog=64)
        host = f"[{advertise}]" if ":" in advertise else advertise
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        # token -> (consumer, its cursor, monotonic deadline)
        self._tickets: dict[str, tuple[str, CacheCursor | None, float]] = {}
        self._connections: set[socket.socket] = set()
        # consumer -> its connection and an event set once that one's sender is gone
        self._current: dict[str, tuple[socket.socket, threading.Event]] = {}
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-feed", daemon=True).start()

    def open(self, consumer: str, cursor: CacheCursor | None) -> FeedTicket:
        token = secrets.token_hex(TOKEN_CHARS // 2)
        now = time.monotonic()
        with self._lock:
            for stale in [t for t, (_, _, deadline) in self._tickets.items() if deadline < now]:
                del self._tickets[stale]
            self._tickets[token] = (consumer, cursor, now + TICKET_TTL_S)
        return FeedTicket(self.address, token)

    def close(self) -> None:
        """Stop listening and end every feed (each consumer sees its connection end)."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):  # already gone
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            if not self._handshakes.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            ticket = self._handshake(conn)
            if ticket is None:
                return
            consumer, cursor = ticket
            done = threading.Event()
            with self._lock:
                if self._closed:
                    return
                self._connections.add(conn)
                old = self._current.get(consumer)
                self._current[consumer] = (conn, done)
            try:
                self._feed(conn, consumer, cursor, old)
            finally:
                with self._lock:
                    self._connections.discard(conn)
                    current = self._current.get(consumer, (None,))[0] is conn
                    if current:
                        del self._current[consumer]
                    gone = current and not self._closed
                done.set()
                if gone:
                    self._left(consumer)

    def _feed(self, conn, consumer: str, cursor: CacheCursor | None, old) -> None:
        """Supersede ``old`` (the consumer's previous connection, if any), then send
        frames until the connection or the server ends."""
        if old is not None:
            with contextlib.suppress(OSError):  # already gone
                old[0].shutdown(socket.SHUT_RDWR)
            # its sender sends nothing more once it is gone: every update after the
            # snapshot below reaches this connection
            old[1].wait(HANDSHAKE_S)
            # the consumer left and is back: with no grace what it left is dropped
            # (there is nothing to hand back), as when it had left first
            self._left(consumer)
        # the snapshot before any command of this connection is taken: what those add
        # reaches the outbox after it, so it goes out with the frames
        live: list[LiveAttempt] | None = self._joined(consumer)
        conn.settimeout(SEND_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._take_commands, args=(conn,), daemon=True).start()
        try:
            while not self._closed:
                polled = self._poll(consumer, HEARTBEAT_S, cursor)
                polled.live, live = live, None
                conn.sendall(encode(polled))
                if polled.cache is not None:
                    cursor = polled.cache.cursor
        except OSError:  # the consumer went away, or close() or a successor shut it
            pass

    def _take_commands(self, conn: socket.socket) -> None:
        """Apply each command the consumer sends, in order, until it stops sending (or
        sends a broken frame or one that is not a command: the connection ends)."""
        buf = bytearray()
        try:
            while not self._closed:
                try:
                    chunk = conn.recv(1 << 16)
                except TimeoutError:  # the sender's timeout; an idle consumer is fine
                    continue
                if not chunk:
                    return
                buf += chunk
                for body in cut(buf):
                    kind, value = decode_command(body)
                    if kind not in self._commands:
                        raise ValueError(
                            f"feed command {kind!r}: this instance takes {sorted(self._commands)}"
                        )
                    self._commands[kind](value)
        except OSError:  # the connection ended
            return
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            log.error("feed: %s; ending the connection", e)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _handshake(self, conn: socket.socket) -> tuple[str, CacheCursor | None] | None:
        """(consumer, cursor) of the live ticket whose token ``conn`` sent first, else None."""
        try:
            conn.settimeout(HANDSHAKE_S)
            token = b""
            while len(token) < TOKEN_CHARS:
                chunk = conn.recv(TOKEN_CHARS - len(token))
                if not chunk:
                    return None
                token += chunk
        except OSError:
            return None
        finally:
            self._handshakes.release()
        with self._lock:
            ticket = self._tickets.pop(token.decode("ascii", "replace"), None)
        if ticket is None or ticket[2] < time.monotonic():
            return None
        return ticket[0], ticket[1]
