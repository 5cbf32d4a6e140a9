"""An instance's update feed (instance/feed.py) on a real ``EngineWorker`` and real
sockets: requests added up it stream down it equal to the offline engine's, cache
changes come with them, an abort up it frees the request's blocks, so does its
consumer leaving, anything but a
command (or one the instance does not take) ends it, it opens only to its ticket's
token, once, and it ends when the instance stops."""

from __future__ import annotations

import socket
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.outputs import Logprobs
from pdserve.instance import feed
from pdserve.instance.feed import HANDSHAKE_S, LENGTH, FeedTicket, decode, encode, frames
from pdserve.instance.messages import Attempt, CacheCursor, CacheDelta, Polled, Reserved, Update
from pdserve.instance.worker import EngineWorker

pytestmark = pytest.mark.timeout(120)

CONFIG = {"num_kv_blocks": 64, "max_batch_tokens": 64, "block_size": 4}
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 11, 3, 7, 2, 8, 14, 6], [21, 4, 4, 17, 30]]


@pytest.fixture(scope="module")
def served(tiny_model):
    path = tiny_model("gqa2")
    want = [o.token_ids for o in LLM(path, **CONFIG).generate(PROMPTS, PARAMS)]
    worker = EngineWorker("colocated-0", path, CONFIG, 1)
    yield worker, want
    worker.stop()


def connect(ticket: FeedTicket, token: str | None = None) -> socket.socket:
    """A connection to the ticket's listener that sent ``token`` (the ticket's own)."""
    conn = socket.create_connection(ticket.endpoint(), timeout=30)
    conn.sendall((ticket.token if token is None else token).encode())
    return conn


def test_frames_round_trip_every_field():
    updates = [
        Update("a#0.1", [3, 4], "hi", info={"phases": {"queued": 1.5}, "kv_bytes": 10}),
        Update("b#0.1", finish_reason="stop", logprobs=[Logprobs(7, -0.5, (7, 2), (-0.5, -1.25))]),
        Update("c#1.2", error="transfer cut", retryable=True),
        Update("d#0.3", handed_off=True),
        Update("h#0.7", error="the json guide: a dead end", invalid=True),
        Update("i#0.8", [5], prompt_logprobs=[None, Logprobs(9, -2.5, (4,), (-0.75,), 3)]),
    ]
    # every field of an update is set by one of them
    blank = Update("x")
    set_ = {f for u in updates for f, v in u.__dict__.items() if v != getattr(blank, f)}
    assert set_ == set(blank.__dict__)
    reserved = [Reserved("e#0.4", b"\x00\x01"), Reserved("f#0.5"), Reserved("g#1.6", error="no")]
    polled = Polled(updates, {"running": 2, "last_step": [1.0, 2.0]},
                    CacheDelta("e1", 9, True, [2**64 - 1, 5], []), reserved)  # fmt: skip
    frame = encode(polled)
    assert LENGTH.unpack_from(frame)[0] == len(frame) - LENGTH.size
    assert decode(frame[LENGTH.size :]) == polled
    assert decode(encode(Polled([], {}))[LENGTH.size :]) == Polled([], {}, None)


def test_greedy_streams_down_the_feed_equal_offline(served):
    worker, want = served
    ticket = worker.open_feed("feed-test", CacheCursor())
    with connect(ticket) as conn:
        got: dict[str, list[int]] = {}
        ended: set[str] = set()
        cached: set[int] = set()
        for i, prompt in enumerate(PROMPTS):
            conn.sendall(
                feed.encode_command("add", Attempt(f"r{i}", tuple(prompt), PARAMS, "feed-test"))
            )
        first = None
        for polled in frames(conn):
            first = first or polled
            assert polled.cache is not None
            polled.cache.apply_to(cached)
            for u in polled.updates:
                assert u.error is None, u.error
                got.setdefault(u.request_id, []).extend(u.token_ids)
                if u.final:
                    ended.add(u.request_id)
            if len(ended) == len(PROMPTS):
                break
        assert first.cache.snapshot  # a new consumer's first frame: every hash cached
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == want
        assert len(cached) >= len(PROMPTS[0]) // CONFIG["block_size"]  # the prompts' full blocks
        # idle: a heartbeat frame (no updates, the stats) within a bound
        conn.settimeout(10)
        heartbeat = next(frames(conn))
        assert heartbeat.updates == [] and heartbeat.stats["running"] == 0
    assert worker.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]


def test_commands_round_trip():
    attempt = Attempt("a#1.2", (5, 6), SamplingParams(temperature=0.5, stop=["x"], seed=3),
                      "router", prefill_tp=2, destination=b"\x00\xff", delivered=(9,))  # fmt: skip
    commands = [("add", attempt), ("prefill", attempt), ("reserve", attempt),
                ("abort", ["a#1.2", "b#0.1"])]  # fmt: skip
    for kind, value in commands:
        frame = feed.encode_command(kind, value)
        assert feed.decode_command(frame[LENGTH.size :]) == (kind, value)
    with pytest.raises(ValueError, match="must be one of"):
        feed.decode_command(encode(Polled([], {}))[LENGTH.size :])


def test_an_abort_up_the_feed_frees_the_request(served):
    worker, _ = served
    ticket = worker.open_feed("abort-test", None)
    long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    with connect(ticket) as conn:
        conn.sendall(
            feed.encode_command("add", Attempt("long", tuple(PROMPTS[0]), long, "abort-test"))
        )
        for polled in frames(conn):
            if any(u.token_ids for u in polled.updates):
                break
        conn.sendall(feed.encode_command("abort", ["long"]))
        for polled in frames(conn):
            if polled.stats["running"] == 0:
                break
    assert worker.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]


def test_a_consumer_that_leaves_has_its_requests_dropped(served):
    """A consumer whose connection ends (a router process killed) is gone for good: its
    requests stop running and their blocks are freed; another consumer's go on."""
    worker, want = served
    long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    stay = worker.open_feed("stays", None)
    with connect(stay) as kept:
        kept.sendall(
            feed.encode_command("add", Attempt("kept", tuple(PROMPTS[1]), PARAMS, "stays"))
        )
        with connect(worker.open_feed("leaves", None)) as conn:
            for i in range(2):
                a = Attempt(f"left{i}", tuple(PROMPTS[0]), long, "leaves")
                conn.sendall(feed.encode_command("add", a))
            for polled in frames(conn):
                if sum(bool(u.token_ids) for u in polled.updates) and polled.stats["running"] >= 2:
                    break
            left_at = polled.stats["tokens_total"]
        got = []
        for polled in frames(kept):
            got += [t for u in polled.updates for t in u.token_ids]
            if polled.stats["running"] == 0:
                break
        assert got == want[1]  # the staying consumer's request ran to its end
    deadline = time.monotonic() + 10
    while worker.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.stats()["running"] == 0
    # dropped within a few steps of leaving, not run to their end (~250 tokens each)
    assert worker.stats()["tokens_total"] - left_at < 100 + len(want[1])
    assert worker.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]


def test_anything_but_a_command_ends_the_feed(served):
    worker, _ = served
    ticket = worker.open_feed("rude", None)
    with connect(ticket) as conn:
        conn.sendall(encode(Polled([], {})))  # a frame of the other direction
        started = time.monotonic()
        for _ in frames(conn):
            pass
        assert time.monotonic() - started < 10


def test_a_command_the_instance_does_not_take_ends_the_feed(served):
    """A co-located instance prefills for no one: ``prefill`` up its feed ends it, and
    nothing of the attempt is kept."""
    worker, _ = served
    ticket = worker.open_feed("not-a-prefiller", None)
    a = Attempt("p#0", tuple(PROMPTS[0]), PARAMS, "not-a-prefiller", destination=b"\x01")
    with connect(ticket) as conn:
        conn.sendall(feed.encode_command("prefill", a))
        started = time.monotonic()
        for polled in frames(conn):
            assert not polled.updates
        assert time.monotonic() - started < 10
    assert worker.stats()["running"] == 0
    assert worker.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]


def test_the_feed_opens_only_to_a_live_token_once(served):
    worker, _ = served
    ticket = worker.open_feed("once", None)
    for token in ("0" * 32, ticket.token[::-1], "x" * 32):
        with connect(ticket, token) as conn:
            assert conn.recv(1) == b""  # closed, nothing sent
    with connect(ticket) as conn:
        assert next(frames(conn)).cache is None  # no cursor on the ticket: no cache changes
    with connect(ticket) as conn:  # used already
        assert conn.recv(1) == b""
    with socket.create_connection(ticket.endpoint(), timeout=30) as silent:
        started = time.monotonic()
        assert silent.recv(1) == b""  # never sent a token: closed after the handshake bound
        assert time.monotonic() - started < HANDSHAKE_S + 5


def test_the_feed_ends_when_the_instance_stops(tiny_model):
    worker = EngineWorker("colocated-1", tiny_model("gqa2"), CONFIG, 1)
    ticket = worker.open_feed("router", None)
    conn = connect(ticket)
    next(frames(conn))
    worker.stop()
    started = time.monotonic()
    for _ in frames(conn):  # what was in flight, then the end
        pass
    assert time.monotonic() - started < 10
    conn.close()


def test_a_tickets_endpoint_is_its_address_split():
    assert FeedTicket("127.0.0.1:4321", "t").endpoint() == ("127.0.0.1", 4321)
    assert FeedTicket("[::1]:4321", "t").endpoint() == ("::1", 4321)  # as the listener writes it
