"""A gRPC client that stops reading a stream: an HTTP/2 connection (h2, the client side
of the protocol by hand) that calls ``Generate``, then never grants the server more
flow-control window. The router's writes wait, and after ``router.write_timeout_s`` it
ends the call (DEADLINE_EXCEEDED naming the key) and takes the request out, while a
client that reads is served meanwhile. (A grpc client would not do: its transport keeps
reading into its own buffers whether the application reads or not.)"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from pdserve.router import pdserve_pb2 as pb
from pdserve.router import pdserve_pb2_grpc as pb_grpc
from tests.cluster.helpers import small_cluster_config, wait_until

WRITE_TIMEOUT_S = 2.0
MAX_TOKENS = 900  # with 20 alternatives per token: ~150 KB, twice HTTP/2's first window


def request(max_tokens: int, logprobs: int | None) -> pb.GenerateRequest:
    sampling = pb.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if logprobs is not None:
        sampling.logprobs = logprobs
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(5, 25))),
                              sampling=sampling)  # fmt: skip


class StalledCall:
    """``Generate`` over a raw HTTP/2 connection that grants no flow-control window until
    ``read``: the server may send one initial window (65,535 bytes) and then must wait. A
    thread keeps the connection itself alive (it acknowledges SETTINGS and answers PINGs,
    as any client's transport does)."""

    def __init__(self, address: str, message: pb.GenerateRequest):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=120)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.stream = self.conn.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":authority", address),
                   (":path", "/pdserve.v1.Router/Generate"),
                   ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
        body = message.SerializeToString()
        self.conn.send_headers(self.stream, headers)
        self.conn.send_data(self.stream, b"\0" + len(body).to_bytes(4, "big") + body, True)
        self.sock.sendall(self.conn.data_to_send())
        self.data, self.status = b"", {}  # the DATA received; grpc-status and -message
        self.ended = threading.Event()
        self.reading = threading.Event()  # set: it grants the window back, as a reader does
        self.unread = 0  # flow-controlled bytes received and not granted back
        self.lock = threading.Lock()  # the connection's state: the thread's and read()'s
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while not self.ended.is_set():
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                with self.lock:
                    self._on(chunk)
        self.ended.set()

    def _on(self, chunk: bytes) -> None:
        for event in self.conn.receive_data(chunk):
            if isinstance(event, h2.events.DataReceived):
                self.data += event.data
                self.unread += event.flow_controlled_length
            elif isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                headers = {k.decode(): v.decode() for k, v in event.headers}
                self.status.update({k: v for k, v in headers.items() if k.startswith("grpc-")})
            elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                self.ended.set()
        self._grant()
        self.sock.sendall(self.conn.data_to_send())  # SETTINGS and PING answers, grants

    def read(self) -> None:
        """From now on, grant the window back for what arrived (a WINDOW_UPDATE)."""
        self.reading.set()
        with self.lock:
            self._grant()
            self.sock.sendall(self.conn.data_to_send())

    def _grant(self) -> None:
        if self.reading.is_set() and self.unread:
            self.conn.acknowledge_received_data(self.unread, self.stream)
            self.unread = 0

    def messages(self) -> list[pb.GenerateResponse]:
        out, at = [], 0
        while at + 5 <= len(self.data):
            size = int.from_bytes(self.data[at + 1 : at + 5], "big")
            if at + 5 + size > len(self.data):
                break
            out.append(pb.GenerateResponse.FromString(self.data[at + 5 : at + 5 + size]))
            at += 5 + size
        return out


@pytest.mark.timeout(300)
def test_a_stream_its_client_stops_reading_is_ended_after_write_timeout_s(chat_model):
    from pdserve.cluster import launch

    config = small_cluster_config(chat_model, write_timeout_s=WRITE_TIMEOUT_S)
    with launch(config) as cluster:
        stalled = StalledCall(cluster.address, request(MAX_TOKENS, 20))
        # the engine finishes the request (the tiny model is fast) while the router's
        # writes wait on the window the client does not grant
        assert wait_until(lambda: cluster.stats()["in_flight"] == 1, 60, interval_s=0.05)
        assert wait_until(lambda: cluster.stats()["in_flight"] == 0, 60, interval_s=0.2)
        # meanwhile a client that reads is served in full
        with grpc.insecure_channel(cluster.address) as other:
            got = list(pb_grpc.RouterStub(other).Generate(request(8, None), timeout=60))
        assert got[-1].finish_reason == "length"
        assert sum(len(m.token_ids) for m in got) == 8
        # the router gives up on the stalled stream within write_timeout_s (bounded
        # generously here); when the client reads at last, what was buffered arrives, then
        # the error (HTTP/2 sends a call's status after its data): it never finished
        time.sleep(3 * WRITE_TIMEOUT_S)
        assert not stalled.ended.is_set()
        assert len(stalled.data) <= 65535
        stalled.read()
        assert stalled.ended.wait(30)
        messages = stalled.messages()
        assert messages and not any(m.finish_reason for m in messages)
        assert sum(len(m.token_ids) for m in messages) < MAX_TOKENS
        deadline_exceeded = str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
        assert stalled.status.get("grpc-status") == deadline_exceeded, stalled.status
        message = urllib.parse.unquote(stalled.status["grpc-message"])
        assert f"router.write_timeout_s={WRITE_TIMEOUT_S:g} s" in message
