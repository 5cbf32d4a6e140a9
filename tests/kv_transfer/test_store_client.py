"""The gloo sender's store client is bounded (kv_transfer/gloo_sender.py,
``_store_client``): torch's ``TCPStore`` client retries with a back-off that its timeout
does not count, so a peer that accepts and never answers held a sender far past it. Here
a real listener accepts and stays silent: the client gives up within its time; and a
real store answers through it."""

from __future__ import annotations

import datetime
import socket
import time

import pytest
from torch.distributed import TCPStore

from kv_transfer.gloo_sender import _store_client


@pytest.mark.timeout(60)
def test_a_silent_peer_is_given_up_within_the_time():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(Exception) as e:  # our TimeoutError, or torch's own, in time
            _store_client("127.0.0.1", port, 1.0)
        elapsed = time.monotonic() - started
    assert elapsed < 1.5, (elapsed, e.value)


@pytest.mark.timeout(60)
def test_a_live_store_answers():
    server = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                      wait_for_workers=False)  # fmt: skip
    server.set("kv/receiver", b"card")
    client = _store_client("127.0.0.1", server.port, 5.0)
    assert client.get("kv/receiver") == b"card"
