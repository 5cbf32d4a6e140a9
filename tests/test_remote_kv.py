"""Remote KV as a request state (engine/reservation.py): ``Scheduler.admit_remote`` holds
blocks for a request whose KV arrives from elsewhere, counted with the running and
waiting requests (the one room check), or refuses with the reason and holds nothing;
a cached prefix is shared and a sliding window's leading blocks are placeholders; no
step runs it until ``land`` moves it to the running batch; ``remove`` frees it; its
blocks make a lone running request that cannot grow wait, not end. Then the same
through ``LLMEngine``: ``reserve``, ``land`` (whose output decodes what the offline
engine does, tests/test_hand_off.py), ``release``, and a refused ``land``. The block
manager's ``check_integrity`` runs after each change."""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.block_manager import PLACEHOLDER, BlockManager
from pdserve.engine.outputs import Logprobs
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.reservation import NoRoom, Reservation
from pdserve.engine.scheduler import Scheduler

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
BS = 4  # block size


def scheduler(num_blocks=16, max_batch_size=4, caching=False, window=None, windows=()):
    blocks = BlockManager(num_blocks, BS, caching, window)
    return Scheduler(blocks, 64, max_batch_size, layer_windows=windows)


def request(rid: str, n: int, start: int = 3) -> Request:
    return Request(rid, list(range(start, start + n)), PARAMS)


def test_admit_remote_holds_its_blocks_and_runs_only_once_landed():
    s = scheduler()
    r = request("r", 10)  # 3 blocks
    got = s.admit_remote(r)
    assert isinstance(got, Reservation)
    assert got == Reservation("r", tuple(s.blocks.block_table("r")), 0, 0, ())
    assert len(got.block_ids) == 3 and s.blocks.num_free_blocks == 13
    assert r.status is RequestStatus.WAITING_FOR_KV and s.remote == {"r": r}
    assert not s.has_unfinished() and not s.schedule()  # no step computes it
    s.blocks.check_integrity()
    with pytest.raises(ValueError, match="request_id='r': already in use"):
        s.admit_remote(request("r", 5))
    s.land(r)
    assert r.status is RequestStatus.RUNNING and s.running == [r] and not s.remote
    assert r.num_computed_tokens == 10 and r.num_pending_tokens == 0
    r.token_ids.append(7)  # the first token, sampled where the KV was computed
    assert s.schedule().items == [(r, 1)]  # it decodes
    s.blocks.check_integrity()
    with pytest.raises(ValueError, match="request_id='r': not waiting for KV here"):
        s.land(r)


def test_the_batch_counts_running_waiting_and_remote_requests():
    s = scheduler(max_batch_size=3)
    s.add(request("w", 5))
    s.schedule()  # w runs
    s.add(request("q", 5))  # waits
    assert isinstance(s.admit_remote(request("a", 5)), Reservation)
    free = s.blocks.num_free_blocks
    refused = s.admit_remote(request("b", 5))
    assert refused == NoRoom("b", "3 requests running, waiting or waiting for KV; max_batch_size=3")
    assert s.blocks.block_table("b") == [] and s.blocks.num_free_blocks == free
    assert "b" not in s.remote
    s.blocks.check_integrity()


def test_no_room_in_the_cache_is_refused_with_the_numbers_and_holds_nothing():
    s = scheduler(num_blocks=4)
    refused = s.admit_remote(request("big", 16))  # 16 tokens + 1: 5 blocks
    assert refused == NoRoom("big", "16 tokens and one more need 5 free blocks, 4 are free")
    assert s.blocks.num_free_blocks == 4 and not s.remote
    assert isinstance(s.admit_remote(request("fits", 15)), Reservation)  # 15 + 1: 4 blocks
    s.blocks.check_integrity()


def test_a_cached_prefix_is_shared_and_not_reserved_again():
    s = scheduler(caching=True)
    first = request("first", 10)
    s.admit_remote(first)
    s.land(first)  # its two full blocks are registered
    s.remove(first)  # they stay CACHED
    again = s.admit_remote(request("again", 10))
    assert isinstance(again, Reservation) and again.cached_blocks == 2
    table = s.blocks.block_table("again")
    assert len(again.block_ids) == 1 and table[2:] == list(again.block_ids)
    assert again.partial_blocks == 2  # the shared ones: never registered again
    s.blocks.check_integrity()


def test_a_sliding_window_reserves_placeholders_and_layer_skips():
    # every layer slides (window 6 tokens): the blocks wholly before the next token's
    # window are placeholders, neither held nor sent
    s = scheduler(window=6, windows=(6, 6))
    r = request("r", 20)  # next token at 20 reads 15..20: blocks 3 and 4
    got = s.admit_remote(r)
    assert isinstance(got, Reservation) and got.outside_blocks == 3
    assert s.blocks.block_table("r")[:3] == [PLACEHOLDER] * 3 and len(got.block_ids) == 2
    assert s.blocks.num_held("r") == 2 and got.layer_skip == ()
    s.blocks.check_integrity()
    # a global layer beside a sliding one: every block is held, the sliding layer skips
    g = scheduler(windows=(6, None))
    got = g.admit_remote(request("g", 20))
    assert isinstance(got, Reservation) and got.outside_blocks == 0
    assert len(got.block_ids) == 5 and got.layer_skip == (3, 0) and got.partial_blocks == 3
    g.blocks.check_integrity()


def test_remove_frees_a_request_waiting_for_kv():
    s = scheduler()
    r = request("r", 10)
    s.admit_remote(r)
    s.remove(r)
    assert not s.remote and s.blocks.num_free_blocks == 16 and s.blocks.block_table("r") == []
    s.blocks.check_integrity()


def test_a_lone_request_that_cannot_grow_beside_a_reservation_waits():
    s = scheduler(num_blocks=4)
    lone = request("lone", 4)
    s.add(lone)
    assert s.schedule().items == [(lone, 4)]
    lone.num_computed_tokens = 4
    lone.token_ids.append(9)  # its first token: the next step needs a second block
    assert isinstance(s.admit_remote(request("r", 11)), Reservation)  # the other 3 blocks
    batch = s.schedule()
    assert not batch and batch.preempted == [lone] and not batch.out_of_cache
    assert lone.status is RequestStatus.WAITING
    s.remove(s.remote["r"])  # released: the lone request resumes
    assert s.schedule().items == [(lone, 5)]
    s.blocks.check_integrity()


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("gqa2")


def test_the_engine_reserves_lands_and_releases(path):
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=8))  # blocks of 16 tokens
    reservation = engine.reserve("a", list(range(3, 40)), PARAMS)
    assert isinstance(reservation, Reservation) and len(reservation.block_ids) == 3
    assert engine.kv_view().block_table("a") == reservation.block_ids
    assert "a" not in engine.requests and not engine.has_unfinished_requests()
    assert engine.stats().waiting_for_kv == 1 and engine.stats().free_blocks == 5
    engine.check_integrity()
    with pytest.raises(ValueError, match="request_id='a': already in use"):
        engine.add_request("a", [3, 4], PARAMS)
    refused = engine.reserve("b", list(range(3, 100)), PARAMS)  # 97 tokens + 1: 7 blocks
    assert refused == NoRoom("b", "97 tokens and one more need 7 free blocks, 5 are free")
    (out,) = engine.land("a", 5)
    assert out.new_token_ids == [5] and out.finish_reason is None
    assert engine.stats().running == 1 and engine.stats().waiting_for_kv == 0
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    engine.reserve("c", [3, 4, 5], PARAMS)
    engine.release("c")  # never landed
    engine.check_integrity()
    assert engine.stats().free_blocks == 8 and engine.kv_view().block_table("c") == ()


def test_a_land_refused_releases_the_reservation(path):
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=8))
    with pytest.raises(ValueError, match="request_id='x': no reservation waits for KV here"):
        engine.land("x", 5)
    engine.reserve("a", [3, 4, 5], PARAMS)
    with pytest.raises(ValueError, match="logprobs=None but the first token came with"):
        engine.land("a", 5, Logprobs(5, -0.1))
    engine.check_integrity()
    assert engine.stats().free_blocks == 8 and engine.stats().waiting_for_kv == 0
    with pytest.raises(ValueError, match="prompt: empty"):  # refused before holding blocks
        engine.reserve("e", [], PARAMS)
    assert engine.stats().free_blocks == 8
