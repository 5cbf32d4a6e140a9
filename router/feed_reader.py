"""The router's end of an instance's update feed (instance/feed.py): an asyncio protocol
on the router's event loop that sends the ticket's token, then cuts the byte stream
into frames and hands each decoded ``Polled`` to ``on_polled``, in order, on the loop;
``send`` writes a command (``add``, ``abort``) the other way.

``lost`` resolves (with why) when the connection ends, which is how the router learns
an instance is gone; a frame whose length prefix exceeds ``instance.feed.MAX_FRAME``
ends it too (a broken stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdserve.instance.feed import cut, decode
from pdserve.instance.messages import Polled
from pdserve.router.incidents import first_line


class FeedReader(asyncio.Protocol):
    def __init__(self, token: str, on_polled: Callable[[Polled], None]):
        self._token = token.encode("ascii")
        self._on_polled = on_polled
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self._transport = transport
        transport.write(self._token)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            bodies = cut(self._buffer)
        except ValueError as e:  # a broken stream
            self._end(f"its feed broke: {e}")
            return
        for body in bodies:
            self._on_polled(decode(body))

    def send(self, frame: bytes) -> None:
        """A command frame (``instance.feed.encode_command``) to the instance."""
        # connection_made ran: create_connection hands out the protocol only after it
        assert self._transport is not None
        self._transport.write(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(f"its feed broke: {first_line(exc)}" if exc else "its feed ended")

    def _end(self, why: str) -> None:
        if not self.lost.done():
            self.lost.set_result(why)
        if self._transport is not None:
            self._transport.close()
