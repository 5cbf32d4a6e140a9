"""Prefix reuse across the prefill -> decode handoff, through the instances' own entry
points in this process (a prefill and a decode instance, a real KV transfer over gRPC
and gloo with checksums, the fault-injecting transport of tests/kv_transfer/faults.py):

- a second turn (prompt = first prompt + first output + new tokens) on the decode
  instance that served the first reserves only the blocks it lacks
  (``KVDestination.cached_blocks``), moves only their KV (``kv_bytes``), reports its
  hit (``kv_cached_tokens``) and the prefill instance's (``cached_tokens``), and decodes
  what the offline engine does with prefix caching off;
- an aborted reservation holding shared blocks, a cut transfer and an expired lease
  leave both instances' ``check_integrity()`` true, every block free and the decode
  instance's cache still holding the prefix (a retry hits it);
- a ``reserve`` up the decode instance's update feed is answered down it.
"""

from __future__ import annotations

import socket
import time
from dataclasses import replace

import pytest
import torch

from pdserve.decode_worker import Receiving
from pdserve.engine import LLM, SamplingParams
from pdserve.instance import feed
from pdserve.instance.messages import Attempt, Update
from pdserve.instance.worker import EngineWorker
from pdserve.kv_transfer import KVDestination
from tests.kv_transfer.faults import ENV, write_plan
from tests.kv_transfer.helpers import WORKER_KV
from tests.roles import part, worker

LEASE_S = 1.0
CONFIG = {"num_kv_blocks": 64, "max_batch_tokens": 32}  # blocks of 16 tokens
FIRST = tuple(3 + (7 * i) % 200 for i in range(40))  # 40 tokens: 2 full blocks + 8
NEW = (5, 6, 7, 8, 9, 10, 11, 12, 13, 14)
OTHER = tuple(250 - (5 * i) % 190 for i in range(70))  # shares no block with FIRST
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["grpc", "gloo"])
def workers(tiny_model, request, tmp_path_factory):
    """A prefill and a decode instance (one torch thread each: restored after)."""
    plan = tmp_path_factory.mktemp("faults") / "plan.json"
    write_plan(plan, [])
    kv = {**WORKER_KV, "backend": f"tests.kv_transfer.faults:{request.param}",
          "lease_s": LEASE_S}  # fmt: skip
    threads, path = torch.get_num_threads(), tiny_model("gqa2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(plan))
        p = worker("prefill", "prefill-0", path, CONFIG, 1, kv)
        d = worker("decode", "decode-0", path, CONFIG, 1, kv)
        yield p, d, plan
        p.stop()
        d.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def turns(tiny_model):
    """The two turns' prompts and ``OTHER``, with the offline engine's (prefix caching
    off) greedy outputs."""
    llm = LLM(tiny_model("gqa2"), enable_prefix_caching=False, **CONFIG)
    first = llm.generate(list(FIRST), PARAMS)[0].token_ids
    second_prompt = (*FIRST, *first, *NEW)
    second, other = llm.generate([list(second_prompt), list(OTHER)], PARAMS)
    return [(FIRST, first), (second_prompt, second.token_ids), (OTHER, other.token_ids)]


def updates_until_final(
    worker, attempt_id: str, timeout_s: float = 60, consumer: str = "test"
) -> list[Update]:
    """``attempt_id``'s updates on ``worker``'s ``consumer`` outbox up to its final one
    (an end, an error or the prefill's hand-off)."""
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        updates = worker.poll(consumer, 0.5).updates
        for u in updates:
            assert u.request_id == attempt_id, (u.request_id, attempt_id)
            got.append(u)
            if u.final or u.handed_off or u.error is not None:
                return got
    raise AssertionError(f"{attempt_id}: no final update within {timeout_s} s")


def block_bytes(d: EngineWorker) -> int:
    """K and V of every layer of one block (all heads): what one block moves."""
    layout = part(d, Receiving).layout
    return 2 * layout.num_layers * layout.block_bytes(layout.num_kv_heads)


def reserve(d: EngineWorker, rid: str, prompt) -> tuple[Attempt, KVDestination]:
    a = Attempt(rid, tuple(prompt), PARAMS, "test", decode=d.name)
    raw = d.reserve(a)
    assert raw is not None
    return replace(a, destination=raw), KVDestination.from_bytes(raw)


def serve(p: EngineWorker, d: EngineWorker, rid: str, prompt) -> tuple[KVDestination, list]:
    """One handoff that succeeds: the destination and the decode instance's updates."""
    a, dst = reserve(d, rid, prompt)
    p.prefill(a)
    out = updates_until_final(d, rid)
    assert out[-1].error is None, out[-1].error
    done = updates_until_final(p, rid)
    assert done[-1].handed_off, done[-1]
    assert done[-1].info["kv_bytes"] == out[0].info["kv_bytes"]  # both saw the same bytes
    return dst, out


def assert_all_free(p: EngineWorker, d: EngineWorker) -> None:
    for w in (p, d):
        blocks = w.check_integrity()  # raises when the accounting is off
        assert blocks["free_blocks"] == blocks["total_blocks"] == CONFIG["num_kv_blocks"]


def test_second_turn_moves_only_the_missing_blocks(workers, turns):
    p, d, _ = workers
    bs = d.engine.blocks.block_size
    (prompt1, want1), (prompt2, want2), _ = turns
    tag = part(d, Receiving).transport.name
    dst, out = serve(p, d, f"t1-{tag}#0", prompt1)
    info = out[0].info
    assert [t for u in out for t in u.token_ids] == want1
    # a fresh decode instance holds nothing; turn 1 may hit the prefill's cache (the
    # other backend's module ran it first): only the decode side's hit changes the bytes
    assert dst.cached_blocks == info["kv_cached_tokens"] == 0
    assert info["kv_bytes"] == len(dst.block_ids) * block_bytes(d) == 3 * block_bytes(d)
    # turn 1 committed prompt + generated tokens whose KV was computed: 40 + 19 -> 3 blocks
    dst, out = serve(p, d, f"t2-{tag}#0", prompt2)
    info = out[0].info
    assert [t for u in out for t in u.token_ids] == want2
    held = min((len(prompt1) + len(want1) - 1) // bs, (len(prompt2) - 1) // bs)
    assert dst.cached_blocks == info["kv_cached_tokens"] // bs == held == 3
    assert len(dst.block_ids) == d.engine.blocks.blocks_for(len(prompt2)) - held == 2
    assert info["kv_bytes"] == 2 * block_bytes(d)
    # the prefill instance computed turn 1's prompt: its 2 full blocks were cached there
    assert info["cached_tokens"] == 2 * bs
    assert_all_free(p, d)


@pytest.mark.parametrize(
    "fault",
    [
        None,  # the client left before the prefill started: the reservation is aborted
        {"side": "sender", "step": "data", "action": "cut", "nth": 2},  # 1 layer of 2 lands
        {"side": "sender", "step": "end", "action": "delay", "nth": 1, "seconds": 1.6 * LEASE_S},
    ],
    ids=["abort", "cut", "lease-expired"],
)
def test_failed_handoffs_with_shared_blocks_free_everything(workers, turns, fault):
    p, d, plan = workers
    prompt, want = turns[2]  # a prompt of its own: the two-turn test may run after
    tag = f"{part(d, Receiving).transport.name}-{'abort' if fault is None else fault['action']}"
    warm, _ = serve(p, d, f"warm-{tag}#0", prompt)  # the prefix is in both caches now
    cached = d.on_loop(lambda: d.engine.blocks.num_cached_blocks)
    a, dst = reserve(d, f"fail-{tag}#0", prompt)
    assert dst.cached_blocks == (len(prompt) - 1) // d.engine.blocks.block_size
    if fault is None:
        d.abort([a.id])
    else:
        write_plan(plan, [{**fault, "match": a.id, "rank": -1}])
        try:
            p.prefill(a)
            err = updates_until_final(d, a.id)[-1]
            assert err.error is not None and err.retryable, err
            assert "made no progress" in err.error, err.error
            assert updates_until_final(p, a.id)[-1].error is not None
        finally:
            write_plan(plan, [])
    assert_all_free(p, d)
    assert d.on_loop(lambda: d.engine.blocks.num_cached_blocks) == cached
    # the retry hits the same cached prefix and decodes the same tokens
    dst, out = serve(p, d, f"fail-{tag}#1", prompt)
    assert dst.cached_blocks * d.engine.blocks.block_size == out[0].info["kv_cached_tokens"] > 0
    assert [t for u in out for t in u.token_ids] == want
    assert_all_free(p, d)


def test_a_resumed_attempt_starts_from_the_cached_prompt_and_output(workers, turns):
    """A migrated request (``delivered`` tokens) reaching the decode instance that holds
    its prompt and output: only the blocks past them move, the continuation is exact."""
    p, d, _ = workers
    prompt, want = turns[2]
    tag = part(d, Receiving).transport.name
    serve(p, d, f"resume-{tag}#0", prompt)  # prompt + output (but the last) now cached
    k = 9
    a = Attempt(f"resume-{tag}#1", tuple(prompt), PARAMS, "test", decode=d.name,
                delivered=tuple(want[:k]))  # fmt: skip
    raw = d.reserve(a)
    dst = KVDestination.from_bytes(raw)
    bs = d.engine.blocks.block_size
    assert dst.cached_blocks == (len(prompt) + k - 1) // bs
    p.prefill(replace(a, destination=raw))
    out = updates_until_final(d, a.id)
    assert [t for u in out for t in u.token_ids] == want[k:]
    assert out[0].info["kv_bytes"] == len(dst.block_ids) * block_bytes(d)
    updates_until_final(p, a.id)
    assert_all_free(p, d)


def test_a_reserve_up_the_update_feed_is_answered_down_it(workers, turns):
    """The router's way: ``reserve`` sent up the decode instance's feed; the
    ``Reserved`` answer (the destination, or the error of an id already in use) comes
    down it, and so do the request's tokens once the prefill instance sent its KV."""
    p, d, _ = workers
    prompt, want = turns[2]
    tag = part(d, Receiving).transport.name
    a = Attempt(f"feed-{tag}#0", tuple(prompt), PARAMS, "via-feed", decode=d.name)
    ticket = d.open_feed("via-feed", None)
    with socket.create_connection(ticket.endpoint(), timeout=30) as conn:
        conn.sendall(ticket.token.encode())
        conn.sendall(feed.encode_command("reserve", a))
        conn.sendall(feed.encode_command("reserve", a))  # the same id again: refused
        answers, tokens = [], []
        for polled in feed.frames(conn):
            answers += polled.reserved
            if len(answers) == 2:
                break
        assert [r.attempt_id for r in answers] == [a.id, a.id]
        raw = answers[0].destination
        assert answers[0].error is None and raw is not None
        assert answers[1].destination is None and "already in use" in answers[1].error
        assert KVDestination.from_bytes(raw).block_ids
        p.prefill(replace(a, destination=raw))
        for polled in feed.frames(conn):
            tokens += [t for u in polled.updates for t in u.token_ids]
            if any(u.final for u in polled.updates):
                break
    assert tokens == want
    assert updates_until_final(p, a.id, consumer="via-feed")[-1].handed_off
    assert_all_free(p, d)
