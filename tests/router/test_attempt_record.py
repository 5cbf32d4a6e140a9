"""A request's two halves at the router, on their own (no Ray, no feed): the attempt
record (router/attempt_record.py) handles each attempt's end once and keeps what the
instances reported across attempts except the prefix hit; an instance's queued prompt
tokens (router/instances.py) are charged and discharged in one place, once per attempt,
whichever path ends it."""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.attempt_record import AttemptRecord
from pdserve.router.instances import Instance
from pdserve.router.policies import CacheAware
from pdserve.router.stream import RequestStream


def test_an_attempt_is_retired_once_and_a_failure_moves_the_next_one_off_its_pair():
    record = AttemptRecord()
    record.begin("r#0.a", ("prefill-0", "decode-0"))
    assert not record.retire("r#0.other") and record.id == "r#0.a"
    assert record.retire("r#0.a") and not record.retire("r#0.a") and record.id == ""
    record.failed("transfer cut")
    assert record.number == 1 and record.failures == ["transfer cut"]
    assert record.avoid == {"prefill-0", "decode-0"}
    record.begin("r#1.b", ("decode-1",))
    assert record.land() and not record.land() and record.landed
    record.begin("r#2.c", ("decode-1",))
    assert not record.landed  # each attempt lands on its own


def test_reports_merge_by_key_and_only_the_prefix_hit_is_per_attempt():
    record = AttemptRecord()
    record.begin("r#0.a", ("prefill-0", "decode-0"))
    record.report({"kv_bytes": 4096, "transfer_s": 0.5, "phases": {"prefill_start": 1.0}})
    record.report({"cached_tokens": 32, "kv_cached_tokens": 16, "prefill_instance": "p"})
    reported = record.reported
    assert (reported.kv_bytes, reported.transfer_s, reported.cached_tokens) == (4096, 0.5, 32)
    assert reported.kv_cached_tokens == 16 and reported.phases == {"prefill_start": 1.0}
    record.begin("r#1.b", ("decode-0",))  # a local attempt reports no handoff
    assert reported.cached_tokens == 0 and reported.kv_bytes == 4096
    stream = RequestStream("r", [1, 2, 3], SamplingParams(max_tokens=2), attempt=record)
    record.report({"cached_tokens": 10})
    assert stream.usage().cached_tokens == 3  # at most the prompt
    assert stream.timings().attempts == 1 and stream.timings().kv_bytes == 4096


def held(request_id: str, attempt_id: str) -> RequestStream:
    stream = RequestStream(request_id, list(range(40)), SamplingParams(max_tokens=2))
    stream.attempt.begin(attempt_id, ("i",))
    return stream


def test_queued_prompt_tokens_are_charged_and_discharged_once_per_attempt():
    inst = Instance("prefill-0", "prefill", None, 0)
    inst.hold(held("a", "a#0.x"), prompt_tokens=40)
    inst.hold(held("b", "b#0.x"), prompt_tokens=25)
    inst.hold(held("c", "c#0.x"))  # holds it, computes none of its prompt
    assert (inst.load.prefill_tokens, inst.load.outstanding) == (65, 3)
    inst.prompt_done("a#0.x")  # its first token is out: still held
    inst.prompt_done("a#0.x")
    assert (inst.load.prefill_tokens, inst.load.outstanding) == (25, 3)
    assert inst.release("a#0.x") and not inst.release("a#0.x")  # nothing charged twice
    assert inst.release("b#0.x")  # released before its prompt was done: discharged
    assert (inst.load.prefill_tokens, inst.load.outstanding) == (0, 1)
    inst.hold(held("d", "d#0.x"), prompt_tokens=7)
    info = {"num_blocks": 10, "block_size": 16, "max_batch_size": 8}
    inst.readmit(None, 1, info)  # a new incarnation holds nothing
    assert inst.load.prefill_tokens == 0
    inst.prompt_done("d#0.x")  # the old incarnation's charge is gone, not subtracted again
    assert inst.load.prefill_tokens == 0


def test_a_cache_aware_choice_reads_copies_of_the_loads():
    from pdserve.router.placement import Colocated, RouterHooks

    def unexpected(*args) -> bool:
        raise AssertionError(f"unexpected call to the router core: {args}")

    insts = [Instance(f"i-{n}", "decode", None, n) for n in range(2)]
    for inst in insts:
        inst.ready, inst.capacity = True, 4
        inst.load.total_blocks = inst.load.free_blocks = 100
    placement = Colocated(RouterHooks(unexpected, unexpected, unexpected), insts, CacheAware())
    stream = held("r", "r#0.x")
    insts[1].cache.hashes.update(stream.block_hashes(16)[:2])
    loads = placement.loads(stream, insts)
    assert [c.hit_tokens for c in loads] == [0, 32]
    assert [i.load.hit_tokens for i in insts] == [0, 0]  # the instances' own are untouched


def test_the_clock_is_written_by_the_stream_placing_it_and_delivering_to_it():
    from pdserve.router.stream import Clock, Delta

    firsts: list[int] = []
    stream = RequestStream("r", [1, 2, 3], SamplingParams(max_tokens=4), clock=Clock(0.0, 1.0))
    stream.on_first_token = lambda: firsts.append(1)
    stream.sent_to("decode-0")
    placed = stream.clock.dispatched_at
    assert placed is not None and stream.clock.first_token_at is None
    stream.deliver(Delta([5, 6], "ab"))
    stream.deliver(Delta([7], "c", "length"))
    clock = stream.clock
    assert firsts == [1] and len(clock.token_walls) == 3  # the first token counted once
    assert clock.first_token_at is not None and clock.last_token_at is not None
    assert placed <= clock.first_token_at <= clock.last_token_at
    t = stream.timings()
    assert t.instances == ["decode-0"] and t.queue_ms == round(placed * 1000.0, 3)
    assert t.ttft_ms <= t.e2e_ms and len(t.phases.tokens) == 3
