"""Hybrid placement (router/hybrid.py) on its own, over instances whose commands are
recorded (no Ray, no feed): with every prefill instance down it still serves,
prefilling on the decode instance; a failed remote attempt's next attempt is local."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.hybrid import Hybrid
from pdserve.router.instances import Instance
from pdserve.router.placement import RouterHooks
from pdserve.router.policies import make_policy
from pdserve.router.prefill_choice import LOCAL, REMOTE, PrefillChoice
from pdserve.router.prefill_costs import CostModel
from pdserve.router.stream import RequestStream


def instance(name: str, role: str, index: int, sent: list) -> Instance:
    class Recorded(Instance):  # its commands recorded instead of sent up a feed
        def add(self, attempt) -> None:
            sent.append(attempt)

        def abort(self, attempt_ids: list[str]) -> None:
            pass

    inst = Recorded(name, role, None, index)
    inst.info = {"max_batch_tokens": 128, "kv_bytes_per_token": 1000}
    inst.ready, inst.capacity = True, 4
    return inst


def hybrid(insts: list[Instance]) -> tuple[Hybrid, list]:
    """A hybrid placement over ``insts``, and the (where, reason) of each choice it makes;
    a migration would fail the test (none happens here)."""
    placed: list = []
    hooks = RouterHooks(
        migrate=lambda stream, why: pytest.fail(f"unexpected migration: {why}"),
        requeue=lambda stream: pytest.fail("unexpected requeue"),
        ended=lambda streams: None,
    )
    costs = CostModel(prefill_ms_per_token=1.0, transfer_mb_per_s=1000.0)
    placement = Hybrid(
        hooks,
        insts,
        make_policy("least_loaded"),
        costs,
        tpot_s=0.15,
        on_choice=lambda c: placed.append((c.where, c.reason)),
    )
    return placement, placed


def pools(sent: list) -> list[Instance]:
    return [instance("prefill-0", "prefill", 0, sent), instance("decode-0", "decode", 1, sent)]


def test_no_prefill_alive_prefills_on_the_decode_instance():
    sent: list = []
    placement, placed = hybrid(pools(sent))
    placement.by_name["prefill-0"].fail("instance prefill-0 failed: gone", restarting=False)
    assert placement.alive and placement.recoverable
    stream = RequestStream("r1", list(range(3, 203)), SamplingParams(max_tokens=4))
    assert placement.can_place(stream)
    placement.place(stream)
    [attempt] = sent
    assert attempt.id == stream.attempt.id and attempt.decode == "decode-0"
    assert placed == [(LOCAL, "no_prefill")] and stream.attempt.pair == ("decode-0",)
    decode = placement.by_name["decode-0"]
    assert decode.load.prefill_tokens == 200 and decode.load.outstanding == 1
    placement.cancel(stream)  # the prompt no longer waits there
    assert decode.load.prefill_tokens == 0 and decode.load.outstanding == 0


def test_after_a_failed_remote_attempt_the_next_is_local():
    sent: list = []
    placement, placed = hybrid(pools(sent))
    stream = RequestStream("r2", list(range(3, 203)), SamplingParams(max_tokens=4))
    stream.attempt.chose(PrefillChoice(REMOTE, "tpot", "", 1.0, 0.5))
    stream.attempt.failed("transfer cut")  # RouterCore.migrate counted the failed one
    placement.place(stream)
    assert placed == [(LOCAL, "fallback")] and len(sent) == 1
    assert stream.attempt.choices[-1].detail.startswith("local (fallback): the remote attempt")


def test_without_a_prefill_pool_the_remote_side_is_the_other_decode_instance():
    sent: list = []
    insts = [instance(f"decode-{i}", "decode", i, sent) for i in range(3)]
    placement, placed = hybrid(insts)
    assert placement.peers
    d0, d1, d2 = insts
    stream = RequestStream("r3", list(range(3, 203)), SamplingParams(max_tokens=4))
    d1.load.prefill_tokens = 50  # the fewest queued prompt tokens among the others: d2
    assert placement._peer_for(stream, d0) is d2
    stream.attempt.avoid.add("decode-2")  # a failed attempt's pair is avoided while another is up
    assert placement._peer_for(stream, d0) is d1
    for d in (d1, d2):
        d.fail(f"instance {d.name} failed: gone", restarting=False)
    assert placement._peer_for(stream, d0) is None
    placement.place(stream)  # no live peer: local
    assert placed == [(LOCAL, "no_prefill")] and [a.decode for a in sent] == ["decode-0"]
