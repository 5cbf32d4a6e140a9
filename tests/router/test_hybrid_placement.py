"""Hybrid placement (router/hybrid.py) on its own, over instances whose commands are
recorded (no Ray, no feed): with every prefill instance down it still serves,
prefilling on the decode instance; a failed remote attempt's next attempt is local."""

from __future__ import annotations

from types import SimpleNamespace

from engine.sampling_params import SamplingParams
from router.hybrid import Hybrid
from router.instances import Instance
from router.policies import make_policy
from router.prefill_choice import LOCAL, REMOTE, PrefillChoice
from router.prefill_costs import CostModel
from router.stream import RequestStream


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


def hybrid(sent: list) -> tuple[Hybrid, list]:
    placed = []
    router = SimpleNamespace(metrics=SimpleNamespace(prefill_placed=lambda *c: placed.append(c)))
    insts = [instance("prefill-0", "prefill", 0, sent), instance("decode-0", "decode", 1, sent)]
    costs = CostModel(prefill_ms_per_token=1.0, transfer_mb_per_s=1000.0)
    return Hybrid(router, insts, make_policy("least_loaded"), costs, tpot_s=0.15), placed


def test_no_prefill_alive_prefills_on_the_decode_instance():
    sent: list = []
    placement, placed = hybrid(sent)
    placement.by_name["prefill-0"].fail("instance prefill-0 failed: gone", restarting=False)
    assert placement.alive and placement.recoverable
    stream = RequestStream("r1", list(range(3, 203)), SamplingParams(max_tokens=4))
    assert placement.can_place(stream)
    placement.place(stream)
    [attempt] = sent
    assert attempt.id == stream.attempt_id and attempt.decode == "decode-0"
    assert placed == [(LOCAL, "no_prefill")] and stream.pair == ("decode-0",)
    decode = placement.by_name["decode-0"]
    assert decode.load.prefill_tokens == 200 and decode.load.outstanding == 1
    placement.cancel(stream)  # the prompt no longer waits there
    assert decode.load.prefill_tokens == 0 and decode.load.outstanding == 0


def test_after_a_failed_remote_attempt_the_next_is_local():
    sent: list = []
    placement, placed = hybrid(sent)
    stream = RequestStream("r2", list(range(3, 203)), SamplingParams(max_tokens=4))
    stream.prefill_choices.append(PrefillChoice(REMOTE, "tpot", "", 1.0, 0.5))
    stream.attempt = 1  # RouterCore.migrate counted the failed one
    placement.place(stream)
    assert placed == [(LOCAL, "fallback")] and len(sent) == 1
    assert stream.prefill_choices[-1].detail.startswith("local (fallback): the remote attempt")


def test_without_a_prefill_pool_the_remote_side_is_the_other_decode_instance():
    sent: list = []
    placed: list = []
    router = SimpleNamespace(metrics=SimpleNamespace(prefill_placed=lambda *c: placed.append(c)))
    insts = [instance(f"decode-{i}", "decode", i, sent) for i in range(3)]
    costs = CostModel(prefill_ms_per_token=1.0, transfer_mb_per_s=1000.0)
    placement = Hybrid(router, insts, make_policy("least_loaded"), costs, tpot_s=0.15)
    assert placement.peers
    d0, d1, d2 = insts
    stream = RequestStream("r3", list(range(3, 203)), SamplingParams(max_tokens=4))
    d1.load.prefill_tokens = 50  # the fewest queued prompt tokens among the others: d2
    assert placement._peer_for(stream, d0) is d2
    stream.avoid.add("decode-2")  # a failed attempt's pair is avoided while another is up
    assert placement._peer_for(stream, d0) is d1
    for d in (d1, d2):
        d.fail(f"instance {d.name} failed: gone", restarting=False)
    assert placement._peer_for(stream, d0) is None
    placement.place(stream)  # no live peer: local
    assert placed == [(LOCAL, "no_prefill")] and [a.decode for a in sent] == ["decode-0"]
