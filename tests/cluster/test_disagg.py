"""Disaggregated serving through real clusters (Ray, the gRPC router, gloo and gRPC KV
transfer between real processes, the real engine on a tiny model): outputs equal the
offline engine's for every backend, layer-wise on and off, 1 and 2 prefill instances,
logprobs and penalties included (the first token's logprobs travel in the handoff);
phase times and KV bytes reach the client; no block leaks anywhere."""

from __future__ import annotations

import asyncio
import random

import pytest
import ray

from pdserve.engine import LLM, SamplingParams
from tests.cluster.helpers import all_blocks_free, wait_until

# pairwise over backend x layer-wise x prefill instances: every pair of values of any
# two of them is one cluster (4 instead of the 8 of the full product)
SETUPS = [
    ("gloo", True, 1),
    ("gloo", False, 2),
    ("grpc", True, 2),
    ("grpc", False, 1),
]


def disagg_config(model: str, backend: str, layerwise: bool, prefills: int, **kv) -> dict:
    pool = {"max_batch_tokens": 128, "kv_blocks": 256, "block_size": 16}
    return {
        "model": model,
        "mode": "disaggregated",
        "router": {"host": "127.0.0.1", "port": 0, "http_port": 0, "max_queue": 64},
        "prefill": {"instances": prefills, **pool, "resources": {"num_cpus": 0.5}},
        "decode": {"instances": 1, **pool, "max_batch_size": 32, "resources": {"num_cpus": 1}},
        "kv_transfer": {"backend": backend, "layerwise": layerwise, "checksum": True, **kv},
    }


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompts of 1-300 tokens (inside a block, across blocks, several 128-token chunks)."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, 256) for _ in range(rng.choice([1, 5, 16, 17, 64, 150, 300]))],
            rng.randint(1, 24),
        )
        for _ in range(n)
    ]


def greedy_outputs(llm, work: list[tuple[list[int], int]]) -> list[list[int]]:
    """The offline greedy tokens of each (prompt ids, max tokens) of ``work``."""
    outs = llm.generate(
        [ids for ids, _ in work],
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work],
    )
    return [o.token_ids for o in outs]


def run_concurrently(client, work) -> list[list]:
    async def one(ids, max_tokens):
        return [
            chunk
            async for chunk in client.agenerate(
                prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
            )
        ]

    async def run_all():
        try:
            return await asyncio.gather(*(one(ids, m) for ids, m in work))
        finally:
            await client.aclose()

    return asyncio.run(run_all())


def check_pools(cluster, within_s: float = 10.0) -> None:
    """Every instance's block manager is consistent and, within ``within_s``, all its
    blocks are free. Asked on each instance's loop: an abort still on its way there (the
    router forgets a cancelled request at once) is waited for, not missed."""

    def blocks():
        return {n: ray.get(h.check_integrity.remote()) for n, h in cluster.workers.items()}

    def free():
        return all(b["free_blocks"] == b["total_blocks"] for b in blocks().values())

    assert wait_until(free, within_s, interval_s=0.1), blocks()


@pytest.fixture(scope="module")
def offline(chat_model):
    return LLM(chat_model)


@pytest.fixture(scope="module")
def expected(offline):
    work = workload(32)
    return work, greedy_outputs(offline, work)


# with logprobs and penalties: the first token's logprobs come from the prefill
# instance in the handoff, the penalties run on both sides (a 150-token prompt: 2 chunks)
LOGPROB_REQUESTS = [
    (list(range(3, 153)), SamplingParams(max_tokens=8, temperature=0, logprobs=3,
                                         repetition_penalty=1.3, presence_penalty=0.5)),
    ([9, 8, 7, 9, 8], SamplingParams(max_tokens=8, temperature=0.8, seed=2,
                                     frequency_penalty=1.0, logprobs=0)),
]  # fmt: skip


@pytest.fixture(scope="module")
def expected_logprobs(offline):
    """What a co-located instance computes for ``LOGPROB_REQUESTS`` (the offline engine)."""
    return [offline.generate(ids, p)[0] for ids, p in LOGPROB_REQUESTS]


def check_logprobs(client, expected_logprobs) -> None:
    """Each of ``LOGPROB_REQUESTS`` through the router has the offline tokens and logprobs."""
    for (ids, p), want in zip(LOGPROB_REQUESTS, expected_logprobs, strict=True):
        got = client.complete(prompt_token_ids=ids, max_tokens=p.max_tokens,
                              temperature=p.temperature, seed=p.seed, logprobs=p.logprobs,
                              repetition_penalty=p.repetition_penalty,
                              presence_penalty=p.presence_penalty,
                              frequency_penalty=p.frequency_penalty, ignore_eos=True)  # fmt: skip
        assert got.token_ids == want.token_ids
        assert [x.top_ids for x in got.logprobs] == [x.top_ids for x in want.logprobs]
        values = [(x.logprob, *x.top_logprobs) for x in got.logprobs]
        assert values == [pytest.approx((x.logprob, *x.top_logprobs), abs=1e-5)
                          for x in want.logprobs]  # fmt: skip


@pytest.mark.parametrize(
    "backend,layerwise,prefills",
    SETUPS,
    ids=[f"{b}-{'layerwise' if lw else 'whole'}-{p}P1D" for b, lw, p in SETUPS],
)
def test_32_concurrent_requests_equal_offline(
    chat_model, expected, expected_logprobs, on_shared_ray, backend, layerwise, prefills
):
    from pdserve.cluster import launch

    work, want = expected
    with launch(disagg_config(chat_model, backend, layerwise, prefills)) as cluster:
        client = cluster.client()
        streams = run_concurrently(client, work)
        for (ids, max_tokens), chunks, tokens in zip(work, streams, want, strict=True):
            assert [t for c in chunks for t in c.token_ids] == tokens
            last = chunks[-1]
            assert last.finish_reason == "length" and last.completion_tokens == max_tokens
            t = last.timings
            prefill, decode = t.instances
            assert prefill.startswith("prefill-") and decode == "decode-0"
            assert t.attempts == 1
            # K and V of every layer for the prompt's blocks (gqa2 tiny: 2 layers,
            # 2 KV heads x 16, fp32)
            assert t.kv_bytes == 2 * 2 * -(-len(ids) // 16) * 16 * 2 * 16 * 4
            p = t.phases
            assert 0 < p["queued"] <= p["prefill_start"] <= p["prefill_end"]
            assert p["transfer_start"] <= p["transfer_end"] <= p["decode_start"]
            assert p["prefill_end"] <= p["transfer_end"]
            assert len(p["tokens"]) == max_tokens and p["tokens"][-1] == p["finish"]
            assert p["decode_start"] <= p["tokens"][0] <= t.ttft_ms + 50
        stats = client.stats()
        used = [i.requests_total for i in stats.instances if i.role == "prefill"]
        assert sum(used) == 32 and all(n > 0 for n in used), used
        check_logprobs(client, expected_logprobs)
        assert wait_until(lambda: all_blocks_free(client.stats()), 10), client.stats()
        check_pools(cluster)
        client.close()


def test_every_isa_serves_the_offline_tokens(isa, chat_model, on_shared_ray):
    """With PDSERVE_CPU_ISA forced (tests/conftest.py isa), the instances run that ISA's
    kernels (they say so in the router's stats) and the cluster's greedy tokens are the
    offline engine's on the same ISA."""
    from pdserve.cluster import launch

    work = workload(8, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    want = [o.token_ids for o in LLM(chat_model).generate([ids for ids, _ in work], params)]
    with launch(disagg_config(chat_model, "gloo", True, 1)) as cluster:
        client = cluster.client()
        streams = run_concurrently(client, work)
        assert [[t for c in chunks for t in c.token_ids] for chunks in streams] == want
        stats = client.stats()
        assert {i.kernels for i in stats.instances} == {isa}, stats
        assert wait_until(lambda: all_blocks_free(client.stats()), 10), client.stats()
        check_pools(cluster)
        client.close()


def test_a_queued_prefill_never_expires_its_lease(chat_model, on_shared_ray):
    """48 long prompts at once on one prefill instance with a small token budget: most
    wait in its queue several times kv_transfer.lease_s, with their decode blocks reserved.
    The lease runs from the first byte of a transfer, so none expires and none is redone."""
    from pdserve.cluster import launch

    # no progress for a lease expires it: 1 s rides out a starved sender on a loaded host
    lease_s = 1.0
    config = disagg_config(chat_model, "gloo", True, 1, lease_s=lease_s)
    config["prefill"]["max_batch_tokens"] = 4
    config["decode"].update(kv_blocks=2048, max_batch_size=64)
    work = [([3 + (i + j) % 250 for j in range(500)], 2) for i in range(48)]
    with launch(config) as cluster:
        client = cluster.client()
        streams = run_concurrently(client, work)
        decode = next(s for s in cluster.stats()["instances"] if s["role"] == "decode")
        assert decode["leases_expired_total"] == 0, decode
        waits = []
        for chunks in streams:
            t = chunks[-1].timings
            assert chunks[-1].finish_reason == "length" and t.attempts == 1, t
            waits.append(t.phases["prefill_start"] - t.phases["queued"])
        assert max(waits) > 3 * lease_s * 1000, max(waits)  # the backlog was real
        assert wait_until(lambda: all_blocks_free(client.stats()), 10), client.stats()
        check_pools(cluster)
        client.close()
