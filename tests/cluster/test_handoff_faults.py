"""The handoff's faults through a real cluster (Ray actors, the gRPC router, the real
engine on a tiny model), injected by the test transport (tests/kv_transfer/faults.py)
into one attempt or every attempt of a request, over gloo and gRPC, with one prefill
rank (two prefill instances: the retry takes the other pair) and with two (the retry
takes the same pair). Each request ends within its bound, redone once with the same
greedy output, or with an error naming the fault; afterwards every instance passes
``check_integrity()`` with every KV block free. tests/kv_transfer/test_handoff.py
walks the same faults through every state of the transfer itself;
tests/cluster/test_disagg_kill.py kills real instances.
"""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.engine import SamplingParams
from tests.cluster.helpers import all_blocks_free, wait_until
from tests.cluster.test_disagg import check_pools, disagg_config
from tests.kv_transfer.faults import ENV, write_plan

LEASE_S = 1.0
PROMPT = list(range(3, 83))  # 80 tokens: 5 blocks
ROWS = [  # name, rules (a sender's rules hit its last rank), attempts (0: an error), words
    ("link cut while receiving", [("sender", "data", "cut", 2)], 2, ""),
    ("END delayed past the lease", [("sender", "end", "delay", 1)], 2, ""),
    ("connection dropped while receiving", [("sender", "data", "disconnect", 2)], 2, ""),
    ("corrupted chunk", [("sender", "data", "corrupt", 1)], 2, ""),
    ("message lost", [("receiver", "data", "drop", 2)], 2, ""),
    ("duplicated message", [("sender", "data", "duplicate", 2)], 1, ""),
    ("duplicated END", [("sender", "end", "duplicate", 1)], 1, ""),
    ("every attempt cut", [("sender", "data", "cut", 2)], 0, "made no progress within"),
]


@pytest.fixture(scope="module", params=[("gloo", 1), ("grpc", 1), ("gloo", 2), ("grpc", 2)],
                ids=["gloo-tp1", "grpc-tp1", "gloo-tp2", "grpc-tp2"])  # fmt: skip
def cluster(chat_model, request, tmp_path_factory):
    from pdserve.cluster import launch

    backend, tp = request.param
    plan = tmp_path_factory.mktemp("faults") / "plan.json"
    write_plan(plan, [])
    config = disagg_config(chat_model, f"tests.kv_transfer.faults:{backend}", True, 3 - tp,
                           lease_s=LEASE_S)  # fmt: skip
    config["prefill"].update(tensor_parallel=tp, resources={"num_cpus": 0.5})
    config["router"]["migration_limit"] = 1  # a second failure ends the request
    config["decode"]["resources"] = {"num_cpus": 0.5}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(plan))  # the cluster's processes inherit it
        with launch(config) as c:
            c.plan, c.tp = plan, tp
            yield c


@pytest.fixture(scope="module")
def want(chat_model):
    from pdserve.engine import LLM

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return LLM(chat_model).generate([PROMPT], params)[0].token_ids


@pytest.mark.parametrize("row", ROWS, ids=[r[0].replace(" ", "_") for r in ROWS])
def test_handoff_fault_through_the_router(cluster, want, row):
    name, rules, attempts, words = row
    rid = f"{name.replace(' ', '-')}-{id(cluster)}"
    match = rid if attempts == 0 else f"{rid}#0"  # every attempt, or the first one only
    write_plan(cluster.plan, [
        {"side": side, "step": step, "action": action, "nth": nth, "match": match,
         "rank": cluster.tp - 1 if side == "sender" else 0, "seconds": 1.6 * LEASE_S,
         "pause_s": 0.3 if action == "disconnect" else 0}
        for side, step, action, nth in rules
    ])  # fmt: skip
    client = cluster.client()
    started = time.monotonic()
    try:
        if attempts == 0:
            with pytest.raises(grpc.RpcError) as err:
                client.complete(prompt_token_ids=PROMPT, max_tokens=6, request_id=rid)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert words in err.value.details() and "after 2 attempts" in err.value.details()
        else:
            done = client.complete(prompt_token_ids=PROMPT, max_tokens=6, temperature=0,
                                   ignore_eos=True, request_id=rid)  # fmt: skip
            assert done.token_ids == want
            assert done.timings.attempts == attempts, done.timings
        # two leases and the prefill's wait for its answers, at most, per attempt
        assert time.monotonic() - started < 2 * (2 * LEASE_S + 1.5 * LEASE_S) + 5
    finally:
        write_plan(cluster.plan, [])
    assert wait_until(lambda: all_blocks_free(client.stats()), 4 * LEASE_S), client.stats()
    check_pools(cluster)
    client.close()


def test_client_leaving_while_the_kv_lands(cluster):
    """The END is held at the decode instance while the client cancels: the reservation
    is released in the middle of the handoff; both pools end with every block free."""
    rid = f"leaving-{id(cluster)}"
    rule = {"side": "receiver", "step": "end", "action": "delay", "match": rid, "seconds": 1.0}
    write_plan(cluster.plan, [rule])
    client = cluster.client()
    try:
        stream = client.generate(prompt_token_ids=PROMPT, max_tokens=50, request_id=rid)
        time.sleep(0.5)
        stream.cancel()
        assert wait_until(lambda: all_blocks_free(client.stats()), 4 * LEASE_S), client.stats()
        check_pools(cluster)
    finally:
        write_plan(cluster.plan, [])
        client.close()
