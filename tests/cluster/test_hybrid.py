"""Hybrid serving through a real cluster (Ray, the gRPC router, gloo KV transfer through
the test transport tests/kv_transfer/faults.py, the engine on a tiny model; 1 prefill and
1 decode instance): short and long prompts take both paths, local prefill on the decode
instance and remote prefill with a handoff, with the offline engine's greedy outputs;
a transfer cut with the only prefill instance alive completes through local prefill.
Each decision shows in ``/metrics`` and in the request's log line; no block leaks.

The choice is made deterministic whatever this machine's speed: ``slo.tpot_ms`` is
tiny, so a prompt placed while the decode instance runs another request goes remote
(reason ``tpot``: any local chunk would stretch that batch's steps past the
objective), and each test has a cluster of its own, whose first request, on idle
instances that have measured nothing yet (equal costs per token on both sides), goes
local (``faster``: no transfer). Later requests go where the measured costs say."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine import LLM, SamplingParams
from tests.cluster.helpers import wait_until
from tests.cluster.test_disagg import check_pools, disagg_config, run_concurrently
from tests.kv_transfer.faults import ENV, write_plan

LEASE_S = 2.0
RUNNER = ([11, 12, 13], 300)  # a short prompt decoding long: keeps the decode batch busy
SHORT = [([5, 6, 7, 8, 9], 6), ([40] * 17, 5), (list(range(30, 50)), 7)]
LONG = [(list(range(3, 153)), 6), ([(7 * i) % 250 + 3 for i in range(300)], 5)]


def hybrid_cluster(chat_model, tmp_path_factory, prefills: int, decode=None, router=None):
    """A hybrid cluster of ``prefills`` prefill instances (the ``decode`` and ``router``
    sections updated), its KV through the test transport, tiny ``slo.tpot_ms``, JSON
    logs; ``.plan``: the transport's fault plan (empty)."""
    from pdserve.cluster import launch

    plan = tmp_path_factory.mktemp("faults") / "plan.json"
    write_plan(plan, [])
    kv = "tests.kv_transfer.faults:gloo"
    config = disagg_config(chat_model, kv, True, prefills, lease_s=LEASE_S)
    config["mode"] = "hybrid"
    config["decode"].update(decode or {})
    config["router"].update(migration_limit=1, **(router or {}))
    config["slo"] = {"ttft_ms": 60_000, "tpot_ms": 0.001}
    config["logging"] = {"format": "json", "level": "INFO"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(plan))  # the cluster's processes inherit it
        with launch(config) as c:
            c.plan = plan
            yield c


@pytest.fixture
def cluster(chat_model, tmp_path_factory):
    yield from hybrid_cluster(chat_model, tmp_path_factory, 1)


@pytest.fixture(scope="module")
def offline(chat_model):
    return LLM(chat_model)


def greedy(offline, work) -> list[list[int]]:
    outs = offline.generate(
        [ids for ids, _ in work],
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work],
    )
    return [o.token_ids for o in outs]


def placements(cluster) -> dict[str, float]:
    """``pdserve:prefill_placement_total`` by "where:reason"."""
    text = httpx.get(f"http://{cluster.http_address}/metrics").text
    return {
        f"{s.labels['where']}:{s.labels['reason']}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pdserve:prefill_placement_total"
    }


def log_line(cluster, request_id: str) -> dict:
    """The request's JSON line in the router actor's log."""
    pid = ray.get(cluster.router.pid.remote())
    logs = Path(cluster.session.temp_dir, "session_latest", "logs")

    def find():
        for path in logs.glob(f"worker-*-{pid}.err"):
            for line in path.read_text().splitlines():
                if f'"{request_id}"' in line:
                    return json.loads(line)
        return None

    line = wait_until(find, 20, interval_s=0.2)
    assert line is not None, request_id
    return line


def test_short_and_long_prompts_take_both_paths(cluster, offline):
    before = placements(cluster)
    with cluster.client() as client:
        runner = client.generate(prompt_token_ids=RUNNER[0], max_tokens=RUNNER[1],
                                 temperature=0, ignore_eos=True)  # fmt: skip
        first = next(runner)  # the first request, on idle instances: local
        with cluster.client() as other:  # placed while the runner decodes: remote
            long_outs = run_concurrently(other, LONG)
        rest = list(runner)
        short_outs = [  # one at a time on the idle decode instance, as the costs say
            client.complete(prompt_token_ids=ids, max_tokens=m, temperature=0, ignore_eos=True)
            for ids, m in SHORT
        ]
    runner_ids = [t for c in [first, *rest] for t in c.token_ids]
    assert runner_ids == greedy(offline, [RUNNER])[0]
    assert [[t for c in out for t in c.token_ids] for out in long_outs] == greedy(offline, LONG)
    assert [o.token_ids for o in short_outs] == greedy(offline, SHORT)
    for out in long_outs:
        t = out[-1].timings
        assert t.instances == ["prefill-0", "decode-0"] and t.kv_bytes > 0, t
    assert rest[-1].timings.instances == ["decode-0"]
    local = sum(o.timings.instances == ["decode-0"] for o in short_outs)
    for o in short_outs:  # local, or remote with a handoff
        assert o.timings.instances in (["decode-0"], ["prefill-0", "decode-0"]), o.timings
    after = placements(cluster)
    assert after["local:faster"] - before.get("local:faster", 0) == 1 + local
    assert after["remote:faster"] - before.get("remote:faster", 0) == len(SHORT) - local
    assert after["remote:tpot"] - before.get("remote:tpot", 0) == len(LONG)
    check_pools(cluster)


def test_cut_transfer_with_one_prefill_instance_completes_locally(cluster, offline):
    """The only prefill instance's transfer is cut after its first layer: the lease runs
    out, and the request's second attempt prefills on the decode instance (a
    disaggregated cluster would wait for that same pair again)."""
    prompt, max_tokens = LONG[0]
    write_plan(cluster.plan, [{"side": "sender", "step": "data", "action": "cut", "nth": 2,
                               "match": "cut-1#0"}])  # fmt: skip
    before = placements(cluster)

    async def run(client):
        try:
            runner = client.agenerate(prompt_token_ids=RUNNER[0], max_tokens=RUNNER[1],
                                      temperature=0, ignore_eos=True)  # fmt: skip
            await anext(runner)  # busy: the next request goes remote
            done = await client.acomplete(prompt_token_ids=prompt, max_tokens=max_tokens,
                                          temperature=0, ignore_eos=True,
                                          request_id="cut-1")  # fmt: skip
            async for _ in runner:
                pass
            return done
        finally:
            await client.aclose()

    try:
        with cluster.client() as client:
            done = asyncio.run(run(client))
    finally:
        write_plan(cluster.plan, [])
    assert done.token_ids == greedy(offline, [(prompt, max_tokens)])[0]
    check_fell_back(cluster, done, before, ["prefill-0", "decode-0"])


def check_fell_back(cluster, done, before: dict, pair: list[str]) -> None:
    """Request ``cut-1`` (``done``) was cut on its way from ``pair`` and prefilled again
    where it decodes: two attempts, one local fallback counted and logged, no block held
    once the lease ran out. ``before``: ``placements`` when it was sent."""
    t = done.timings
    assert t.attempts == 2 and t.instances[:2] == pair, t
    assert len(t.instances) == 3, t  # the second attempt: one instance, prefill and decode
    after = placements(cluster)
    assert after["local:fallback"] - before.get("local:fallback", 0) == 1
    line = log_line(cluster, "cut-1")
    assert line["prefill"] == ["remote:tpot", "local:fallback"], line
    assert line["attempts"] == 2 and line["outcome"] == "length"
    check_pools(cluster, within_s=3 * LEASE_S)
