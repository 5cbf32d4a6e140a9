"""Every attempt is handled once (``AttemptRecord.retire``, router/attempt_record.py), on
the disaggregated placement alone over instances whose commands are recorded (no Ray,
no feed): a decode instance that fails while its reservation is pending reports the
attempt's end twice (its death, then the reservation's failure) and the request
migrates once; a hold left on a failed instance goes at its next ``on_dead`` without
touching the request. tests/cluster/test_attempts.py does the same with real processes
and signals."""

from __future__ import annotations

import asyncio

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.disagg import Disaggregated
from pdserve.router.instances import Instance
from pdserve.router.placement import RouterHooks
from pdserve.router.policies import make_policy
from pdserve.router.stream import RequestStream


def instance(name: str, role: str, index: int, aborted: list) -> Instance:
    class Recorded(Instance):  # its aborts recorded; other commands wait for a feed
        def abort(self, attempt_ids: list[str]) -> None:
            aborted.extend(attempt_ids)

    inst = Recorded(name, role, None, index)
    inst.ready, inst.capacity = True, 4
    return inst


def placement(migrated: list, aborted: list) -> Disaggregated:
    def migrate(stream, why):
        migrated.append((stream.request_id, why))
        stream.attempt.failed(why)
        return True

    router = RouterHooks(migrate=migrate, requeue=lambda stream: None, ended=lambda ended: None)
    insts = [
        instance("prefill-0", "prefill", 0, aborted),
        instance("decode-0", "decode", 1, aborted),
    ]
    return Disaggregated(router, insts, make_policy("least_loaded"))


def test_a_decode_failure_while_reserving_migrates_the_request_once():
    migrated, aborted = [], []

    async def main():
        disagg = placement(migrated, aborted)
        prefill, decode = disagg.prefills[0], disagg.decodes[0]
        stream = RequestStream("r1", list(range(3, 83)), SamplingParams(max_tokens=4))
        disagg.place(stream)
        first = stream.attempt.id
        assert set(decode.streams) == set(prefill.streams) == {first}
        await asyncio.sleep(0)  # the reservation goes out and waits for its answer
        assert first in decode._reserving
        decode.fail("instance decode-0 failed: killed", restarting=True)  # its answer fails
        disagg.on_dead(decode)  # the first report: the instance's death
        await asyncio.gather(*disagg._tasks)  # the second: the failed reservation
        return disagg, stream, first

    disagg, stream, first = asyncio.run(main())
    assert migrated == [("r1", "instance decode-0 failed: killed")], migrated
    assert stream.attempt.number == 1 and stream.attempt.id == ""
    assert all(not i.streams and i.load.outstanding == 0 for i in disagg.instances)
    assert all(i.load.prefill_tokens == 0 for i in disagg.instances)
    assert aborted == [first]  # the prefill instance is told once; the dead one cannot be


def test_a_stale_hold_on_a_failed_instance_goes_without_touching_its_request():
    migrated, aborted = [], []

    async def main():
        disagg = placement(migrated, aborted)
        decode = disagg.decodes[0]
        stream = RequestStream("r2", list(range(3, 83)), SamplingParams(max_tokens=4))
        disagg.place(stream)
        current = stream.attempt.id
        decode.streams["r2#0.stale"] = stream  # an earlier attempt's hold, left behind
        decode.load.outstanding += 1
        decode.fail("instance decode-0 failed: killed", restarting=True)
        disagg.on_dead(decode)
        await asyncio.gather(*disagg._tasks)
        assert not decode.streams and decode.load.outstanding == 0
        disagg.on_dead(decode)  # again (the readmission's clean-up): nothing more happens
        return current

    current = asyncio.run(main())
    assert migrated == [("r2", "instance decode-0 failed: killed")], migrated
    assert aborted == [current]
