"""The port a tensor-parallel instance's rank 0 will serve its store on
(``cluster.actors._free_port``) lies outside the kernel's ephemeral range, so no
``bind(0)`` or outgoing connection of another process takes it before rank 0 binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdserve.cluster.actors import _free_port


@pytest.mark.timeout(30)
def test_the_store_port_is_free_and_outside_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    taken = []
    try:
        for _ in range(20):
            bind, advertise, port = _free_port("127.0.0.1", None)
            assert (bind, advertise) == ("127.0.0.1", "127.0.0.1")
            assert 20000 <= port < low, port
            s = socket.socket()
            s.bind((bind, port))  # free: nothing else holds it
            taken.append(s)
        assert len({s.getsockname()[1] for s in taken}) == 20
    finally:
        for s in taken:
            s.close()
