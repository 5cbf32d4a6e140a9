"""Hybrid serving without a prefill pool through a real cluster (Ray, the gRPC router,
gloo KV transfer through the test transport tests/kv_transfer/faults.py, the engine on
a tiny model; 2 decode instances that prefill for each other): a prompt is computed on
its decode instance or on the other one, whose KV is handed off beside its own
decodes, with the offline engine's greedy outputs; a transfer cut from the peer
completes through local prefill. Each decision shows in ``/metrics`` and in the
request's log line; no block leaks.

The choice is made deterministic whatever this machine's speed: ``slo.tpot_ms`` is
tiny, so any chunk beside a running batch would stretch its steps past the objective;
``round_robin`` sends requests to decode-0, decode-1, decode-0, ... Then a request
for an idle instance whose peer runs a batch stays local (``tpot``: the peer's batch
would be stretched) and one for a busy instance whose peer is idle goes to the peer
(``remote:tpot``). Each test has a cluster of its own."""

from __future__ import annotations

import asyncio

import pytest

from tests.cluster.test_disagg import check_pools
from tests.cluster.test_hybrid import (
    LONG,
    RUNNER,
    SHORT,
    check_fell_back,
    greedy,
    hybrid_cluster,
    log_line,
    placements,
)
from tests.kv_transfer.faults import write_plan


@pytest.fixture
def cluster(chat_model, tmp_path_factory):
    decode = {"instances": 2, "resources": {"num_cpus": 0.5}}
    yield from hybrid_cluster(chat_model, tmp_path_factory, 0, decode, {"policy": "round_robin"})


@pytest.fixture(scope="module")
def offline(chat_model):
    from pdserve.engine import LLM

    return LLM(chat_model)


def sample(ids, max_tokens, **kw) -> dict:
    return dict(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


async def beside_a_runner(client, requests):
    """The runner on decode-0 (first token out), then ``requests`` one after the other
    (round robin: decode-1, decode-0, ...), then the runner's rest."""
    try:
        runner = client.agenerate(**sample(*RUNNER))
        first = await anext(runner)
        done = [await client.acomplete(**sample(*r[:2], **r[2])) for r in requests]
        rest = [c async for c in runner]
        return [first, *rest], done
    finally:
        await client.aclose()


def test_a_prompt_is_prefilled_on_the_peer_of_a_busy_decode_instance(cluster, offline):
    before = placements(cluster)
    # decode-1, idle beside a busy peer: local; decode-0, busy beside an idle peer: remote
    requests = [(*SHORT[0], {}), (*LONG[0], {"request_id": "on-peer"})]
    with cluster.client() as client:
        runner, (short, long) = asyncio.run(beside_a_runner(client, requests))
    assert [t for c in runner for t in c.token_ids] == greedy(offline, [RUNNER])[0]
    assert [short.token_ids, long.token_ids] == greedy(offline, [SHORT[0], LONG[0]])
    assert runner[-1].timings.instances == ["decode-0"]
    assert short.timings.instances == ["decode-1"], short.timings
    t = long.timings
    assert t.instances == ["decode-1", "decode-0"] and t.kv_bytes > 0, t
    after = placements(cluster)
    for label, n in (("local:faster", 1), ("local:tpot", 1), ("remote:tpot", 1)):
        assert after[label] - before.get(label, 0) == n, (label, after, before)
    line = log_line(cluster, "on-peer")
    assert line["prefill"] == ["remote:tpot"] and line["instances"] == ["decode-1", "decode-0"]
    check_pools(cluster)


def test_a_transfer_cut_from_the_peer_completes_through_local_prefill(cluster, offline):
    """decode-1's transfer to decode-0 is cut after its first layer: the lease runs out,
    and the request's second attempt prefills where it decodes."""
    prompt, max_tokens = LONG[0]
    write_plan(cluster.plan, [{"side": "sender", "step": "data", "action": "cut", "nth": 2,
                               "match": "cut-1#0"}])  # fmt: skip
    before = placements(cluster)
    requests = [(*SHORT[0], {}), (prompt, max_tokens, {"request_id": "cut-1"})]
    try:
        with cluster.client() as client:
            runner, (_, done) = asyncio.run(beside_a_runner(client, requests))
    finally:
        write_plan(cluster.plan, [])
    assert done.token_ids == greedy(offline, [(prompt, max_tokens)])[0]
    check_fell_back(cluster, done, before, ["decode-1", "decode-0"])
