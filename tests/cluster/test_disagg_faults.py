"""Failures in disaggregated serving, injected into a real cluster by the test transport
(tests/kv_transfer/faults.py): a KV transfer cut midway, a corrupted chunk, a client
that leaves, a full decode pool. The request is redone once on another pair or fails
with a clear error; no block leaks anywhere."""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.engine import SamplingParams
from tests.cluster.helpers import all_blocks_free, fill_then_refuse, wait_until
from tests.cluster.test_disagg import check_pools, disagg_config
from tests.kv_transfer.faults import ENV, write_plan

LEASE_S = 2.0
PROMPT = [7, 8, 9, 10] * 10  # 40 tokens: 3 blocks


@pytest.fixture(scope="module", params=["gloo", "grpc"])
def cluster(chat_model, request, tmp_path_factory):
    from pdserve.cluster import launch

    plan = tmp_path_factory.mktemp("faults") / "plan.json"
    write_plan(plan, [])
    backend = f"tests.kv_transfer.faults:{request.param}"
    config = disagg_config(chat_model, backend, True, 2, lease_s=LEASE_S)
    config["router"]["migration_limit"] = 1  # a second failure ends the request
    config["decode"]["max_batch_size"] = 4
    config["router"]["max_queue"] = 4
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(plan))  # the cluster's processes inherit it
        with launch(config) as c:
            c.plan = plan
            yield c


def inject(cluster, *rules) -> None:
    write_plan(cluster.plan, list(rules))


@pytest.fixture(scope="module")
def client(cluster):
    with cluster.client() as c:
        yield c


@pytest.fixture(scope="module")
def want(chat_model):
    from pdserve.engine import LLM

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return LLM(chat_model).generate([PROMPT], params)[0].token_ids


def settle(cluster, client) -> None:
    inject(cluster)
    assert wait_until(lambda: all_blocks_free(client.stats()), 3 * LEASE_S), client.stats()
    check_pools(cluster)


def test_transfer_cut_midway_is_redone_on_another_pair(cluster, client, want):
    # the first attempt's link goes down after layer 0 of 2; an idle cluster places on
    # prefill-0 (fewest queued tokens, then index), the retry on prefill-1
    inject(cluster, {"side": "sender", "step": "data", "action": "cut", "nth": 2, "match": "#0"})
    started = time.monotonic()
    done = client.complete(prompt_token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert done.token_ids == want
    assert time.monotonic() - started >= LEASE_S * 0.9  # the first attempt's lease ran out
    t = done.timings
    assert t.attempts == 2
    first, second = t.instances[0], t.instances[2]
    assert (first, second) == ("prefill-0", "prefill-1")
    settle(cluster, client)


def test_transfer_cut_twice_fails_with_a_clear_error(cluster, client):
    inject(cluster, {"side": "sender", "step": "data", "action": "cut", "nth": 2})
    with pytest.raises(grpc.RpcError) as err:
        client.complete(prompt_token_ids=PROMPT, max_tokens=8, temperature=0)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    text = err.value.details()
    assert "made no progress within kv_transfer.lease_s=2s" in text, text
    assert "after 2 attempts" in text, text
    settle(cluster, client)


def test_corrupted_chunk_is_caught_by_the_checksum_and_redone(cluster, client, want):
    inject(cluster, {"side": "sender", "step": "data", "action": "corrupt", "match": "#0"})
    done = client.complete(prompt_token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert done.token_ids == want and done.timings.attempts == 2
    inject(cluster)
    # prefill-0 again (idle cluster), over the same pair
    other = client.complete(prompt_token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert other.token_ids == want and other.timings.attempts == 1
    settle(cluster, client)


def test_client_leaving_frees_blocks_on_both_pools(cluster, client):
    stream = client.generate(prompt_token_ids=PROMPT, max_tokens=500, ignore_eos=True)
    next(stream)
    stream.cancel()
    settle(cluster, client)


def test_full_decode_pool_queues_then_refuses(cluster, client):
    capacity, max_queue = 4, 4  # decode.max_batch_size, router.max_queue

    def check(stats):
        decode = next(i for i in stats.instances if i.role == "decode")
        assert decode.outstanding == capacity

    fill_then_refuse(client, PROMPT, capacity, max_queue, check)
    settle(cluster, client)
    assert client.complete(prompt_token_ids=PROMPT, max_tokens=2).completion_tokens == 2
