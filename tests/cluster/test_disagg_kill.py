"""Instances killed in the middle of a handoff (a real SIGKILL to a real Ray worker
process, sent by the test transport at a chosen step): the prefill instance while it
sends a request's KV, then the decode instance while it receives one. Each request is
redone on the surviving pair with the same greedy output; the victim is restarted and
serves again; every instance passes ``check_integrity()`` with every KV block free."""

from __future__ import annotations

import time

import pytest
import ray

from pdserve.engine import SamplingParams
from tests.cluster.helpers import wait_until
from tests.cluster.test_disagg import disagg_config
from tests.kv_transfer.faults import ENV, write_plan

LEASE_S = 1.0
PROMPT = list(range(3, 83))  # 80 tokens: 5 blocks


@pytest.mark.parametrize("backend", ["gloo", "grpc"])
def test_killed_sender_then_killed_receiver_are_survived(chat_model, backend, tmp_path):
    from pdserve.cluster import launch
    from pdserve.engine import LLM

    want = (
        LLM(chat_model)
        .generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        .token_ids
    )
    plan = tmp_path / "plan.json"
    write_plan(plan, [])
    config = disagg_config(chat_model, f"tests.kv_transfer.faults:{backend}", True, 2,
                           lease_s=LEASE_S)  # fmt: skip
    config["decode"].update(instances=2, resources={"num_cpus": 0.5})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(plan))
        with launch(config) as cluster, cluster.client() as client:
            for side, victim in (("sender", "prefill-0"), ("receiver", "decode-0")):
                rid = f"kill-{side}"
                write_plan(plan, [{"side": side, "step": "data", "action": "kill", "nth": 2,
                                   "match": f"{rid}#0", "pause_s": 0.3}])  # fmt: skip
                started = time.monotonic()
                done = client.complete(prompt_token_ids=PROMPT, max_tokens=6, temperature=0,
                                       ignore_eos=True, request_id=rid)  # fmt: skip
                assert done.token_ids == want
                assert done.timings.attempts == 2 and victim in done.timings.instances
                assert victim not in done.timings.instances[2:], done.timings.instances
                assert time.monotonic() - started < 3 * LEASE_S + 10
                assert wait_until(lambda v=victim: restarted(cluster, v), 90), cluster.stats()
            write_plan(plan, [])

            def settled():
                live = [s for s in cluster.stats()["instances"] if s["state"] == "serving"]
                return len(live) == 4 and all(s["free_blocks"] == s["total_blocks"] for s in live)

            assert wait_until(settled, 4 * LEASE_S), cluster.stats()
            for name, worker in cluster.workers.items():
                blocks = ray.get(worker.check_integrity.remote())
                assert blocks["free_blocks"] == blocks["total_blocks"], (name, blocks)


def restarted(cluster, name: str) -> bool:
    """The supervisor restarted ``name`` and the router serves it again."""
    (mine,) = [s for s in cluster.stats()["instances"] if s["name"] == name]
    return mine["state"] == "serving" and mine["restarts"] >= 1
