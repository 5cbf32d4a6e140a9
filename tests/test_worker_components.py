"""Roles as components (instance/component.py) on real ``EngineWorker``s of a tiny model:
each role's worker serves its components' calls and refuses the others naming its role,
reports their ready facts and stats, and no two parts of a worker may take one inbox
message, feed command or call."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.instance.component import Component
from pdserve.instance.inbox import Add
from pdserve.instance.messages import Attempt, Update
from pdserve.instance.worker import EngineWorker
from tests.kv_transfer.helpers import WORKER_KV
from tests.roles import worker

pytestmark = pytest.mark.timeout(120)

CONFIG = {"num_kv_blocks": 32, "max_batch_tokens": 32, "block_size": 4}
ATTEMPT = Attempt("r#0", (5, 9, 11), SamplingParams(max_tokens=2), "test")


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("gqa2")


def test_a_colocated_worker_refuses_every_roles_call(path):
    w = worker("colocated", "colocated-0", path, CONFIG, 1)
    try:
        assert w.ready()["role"] == "colocated" and w.components == []
        for call in (
            lambda: w.prefill(ATTEMPT),
            lambda: w.reserve(ATTEMPT),
            lambda: w.rank_acked("r#0", 1, 0, None),
            lambda: w.rank_landed("r#0", 1, 0, None),
        ):
            with pytest.raises(ValueError, match="not served by a colocated instance"):
                call()
    finally:
        w.stop()


@pytest.mark.parametrize("peers", [False, True])
def test_a_decode_worker_prefills_only_for_peers(path, peers):
    w = worker("decode", "decode-0", path, CONFIG, 1, WORKER_KV, peers=peers)
    try:
        facts, stats = w.ready(), w.stats()
        assert facts["role"] == "decode" and facts["kv_addresses"], facts
        assert ("kv_tp_size" in facts) == peers, facts  # the sending component's fact
        assert stats["reserved"] == 0 and ("in_transfer" in stats) == peers, stats
        assert w.reserve(ATTEMPT) is not None  # room: a destination
        assert w.stats()["reserved"] == 1
        w.abort([ATTEMPT.id])
        w.on_loop(lambda: None)  # the abort applied before this
        assert w.stats()["reserved"] == 0
        if not peers:
            with pytest.raises(ValueError, match="'prefill' is not served by a decode"):
                w.prefill(ATTEMPT)
    finally:
        w.stop()


def test_a_prefill_worker_refuses_the_receiving_calls(path):
    w = worker("prefill", "prefill-0", path, CONFIG, 1, WORKER_KV)
    try:
        facts, stats = w.ready(), w.stats()
        assert facts["role"] == "prefill" and facts["kv_tp_size"] == 1, facts
        assert stats["in_transfer"] == 0 and stats["kv_bytes_total"] == 0, stats
        with pytest.raises(ValueError, match="'reserve' is not served by a prefill"):
            w.reserve(ATTEMPT)
        with pytest.raises(ValueError, match="'rank_landed' is not served by a prefill"):
            w.rank_landed("r#0", 1, 0, None)
    finally:
        w.stop()


class TakesAdd(Component):
    """A part that claims the worker's own ``Add`` message."""

    def handlers(self):
        return {Add: lambda m: [Update(m.attempt.id)]}

    def owns(self, request_id: str) -> bool:
        return False

    def abort(self, request_id: str) -> list[Update]:
        return []

    def fail(self, request_ids: list[str]) -> None:
        return None

    def close(self) -> None:
        return None


def test_two_parts_may_not_take_one_message(path):
    with pytest.raises(ValueError, match="TakesAdd takes Add, which another part"):
        EngineWorker("colocated-0", path, CONFIG, 1, components=(TakesAdd,), kv={})


def test_a_role_and_its_kv_config_are_checked(path):
    with pytest.raises(ValueError, match=r"role='mixed': one of \['colocated', 'prefill'"):
        EngineWorker("x-0", path, CONFIG, 1, role="mixed")
    with pytest.raises(ValueError, match="kv=None: the components \\['TakesAdd'\\]"):
        EngineWorker("x-0", path, CONFIG, 1, components=(TakesAdd,))
