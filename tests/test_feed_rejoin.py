"""Rejoining an instance's update feed (instance/feed.py, "Rejoining") on a real
``EngineWorker`` with a grace (``rejoin_grace_s``) and real sockets: a consumer that
leaves and comes back under its name within the grace finds its requests still
running, handed back with every token they produced (what it may have missed) and the
later frames carrying exactly what follows, equal to the offline engine's; a
connection under a name that has one supersedes it without dropping anything; a
consumer that does not come back has its requests dropped at the grace's end, their
blocks freed."""

from __future__ import annotations

import socket
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.instance import feed
from pdserve.instance.feed import FeedTicket, frames
from pdserve.instance.messages import Attempt, Polled
from pdserve.instance.worker import EngineWorker

pytestmark = pytest.mark.timeout(120)

CONFIG = {"num_kv_blocks": 640, "max_batch_tokens": 64, "block_size": 4, "max_batch_size": 2}
GRACE_S = 3.0
LONG = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
PROMPTS = [[5, 9, 11, 3, 7, 2, 8, 14, 6], [21, 4, 4, 17, 30]]


@pytest.fixture(scope="module")
def served(tiny_model):
    path = tiny_model("gqa2")
    want = [o.token_ids for o in LLM(path, **CONFIG).generate(PROMPTS, LONG)]
    feed_at = {"bind": "127.0.0.1", "advertise": "127.0.0.1", "rejoin_grace_s": GRACE_S}
    worker = EngineWorker("colocated-0", path, CONFIG, 1, feed=feed_at)
    yield worker, want
    worker.stop()


def connect(ticket: FeedTicket) -> socket.socket:
    conn = socket.create_connection(ticket.endpoint(), timeout=30)
    conn.sendall(ticket.token.encode())
    return conn


def add_all(conn: socket.socket, consumer: str, tag: str) -> list[str]:
    ids = []
    for i, prompt in enumerate(PROMPTS):
        ids.append(f"{tag}{i}#0.x")
        attempt = Attempt(ids[-1], tuple(prompt), LONG, consumer, context=b"\x81\xa1k\x01")
        conn.sendall(feed.encode_command("add", attempt))
    return ids


def read_until(conn: socket.socket, got: dict[str, list[int]], done) -> Polled:
    """Frames into ``got`` (tokens by attempt id) until ``done(polled)``; the first."""
    first = None
    for polled in frames(conn):
        first = first or polled
        for u in polled.updates:
            assert u.error is None, u.error
            got.setdefault(u.request_id, []).extend(u.token_ids)
        if done(polled):
            return first
    raise AssertionError("the feed ended")


def running(n: int):
    return lambda polled: polled.stats["running"] >= n and polled.updates


def idle(polled: Polled) -> bool:
    return polled.stats["running"] == 0 and polled.stats["queued"] == 0


def test_a_consumer_back_within_the_grace_gets_its_requests_and_every_token(served):
    worker, want = served
    before: dict[str, list[int]] = {}
    with connect(worker.open_feed("router", None)) as conn:
        first = read_until(conn, {}, lambda polled: True)
        assert first.live == []  # a new consumer: nothing held for it
        ids = add_all(conn, "router", "a")
        read_until(conn, before, running(2))
    time.sleep(0.3)  # gone: the requests run on, their updates pile up
    after: dict[str, list[int]] = {}
    with connect(worker.open_feed("router", None)) as conn:
        first = read_until(conn, after, idle)
    live = {a.attempt.id: a for a in first.live}
    assert sorted(live) == sorted(ids)
    for i, rid in enumerate(ids):
        a = live[rid]
        assert a.attempt.context == b"\x81\xa1k\x01" and a.attempt.prompt_ids == tuple(PROMPTS[i])
        # what the consumer had is a prefix of what the instance hands back
        assert a.token_ids[: len(before.get(rid, []))] == before.get(rid, [])
        assert a.marks[-1] == [len(a.token_ids), len(a.text)]
        assert a.token_ids + after.get(rid, []) == want[i]  # no token twice, none missed
    assert worker.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]


def test_a_second_connection_under_a_name_supersedes_the_first(served):
    worker, want = served
    got: dict[str, list[int]] = {}
    old = connect(worker.open_feed("twice", None))
    try:
        ids = add_all(old, "twice", "b")
        read_until(old, got, running(2))
        with connect(worker.open_feed("twice", None)) as new:
            rest: dict[str, list[int]] = {}
            first = read_until(new, rest, idle)
            old.settimeout(10)
            for _ in frames(old):  # to its end (superseded); a timeout fails the test
                pass
    finally:
        old.close()
    live = {a.attempt.id: a for a in first.live}
    for i, rid in enumerate(ids):
        assert live[rid].token_ids + rest.get(rid, []) == want[i]
    assert worker.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]


def test_a_consumer_not_back_within_the_grace_has_its_requests_dropped(served):
    worker, _ = served
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    n = 40  # two at a time: many times the grace's worth of work
    with connect(worker.open_feed("gone", None)) as conn:
        read_until(conn, {}, lambda polled: True)
        for i in range(n):
            prompt = tuple(PROMPTS[i % 2])
            conn.sendall(feed.encode_command("add", Attempt(f"c{i}#0.x", prompt, long, "gone")))
        read_until(conn, {}, running(2))
        left, tokens = time.monotonic(), worker.stats()["tokens_total"]
    time.sleep(GRACE_S / 2)
    assert worker.stats()["running"] == 2  # kept within the grace
    deadline = left + GRACE_S + 10
    while not idle(Polled([], worker.stats())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(Polled([], worker.stats()))
    assert time.monotonic() - left >= GRACE_S
    assert worker.stats()["tokens_total"] - tokens < (n - 2) * 1000  # dropped, not run
    assert worker.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]
    # nothing is handed back to a consumer of that name now
    with connect(worker.open_feed("gone", None)) as conn:
        assert read_until(conn, {}, lambda polled: True).live == []
