"""Cache-aware routing on a real co-located cluster (two instances of the tiny chat
model, ``router.policy: cache_aware``, blocks of 16 tokens): requests that share a long
prefix land on the instance whose prefix cache holds it, and the cached tokens reported
in the gRPC final message, in OpenAI's ``usage.prompt_tokens_details`` (the official
``openai`` client) and in ``/metrics`` (prometheus_client's parser) are the block math.

Each test uses prefixes of its own (random token ids), so none depends on another's."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pdserve.cluster.cli_router import _summary
from tests.cluster.helpers import small_cluster_config
from tests.cluster.test_router_metrics import delta, scrape

BS = 16  # small_cluster_config's block_size


@pytest.fixture(scope="module")
def cluster(chat_model):
    from pdserve.cluster import launch

    c = launch(small_cluster_config(chat_model, policy="cache_aware"))
    yield c
    c.shutdown(drain=False)


@pytest.fixture(scope="module")
def client(cluster):
    from pdserve.router.client import RouterClient

    with RouterClient(cluster.address) as c:
        yield c


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def complete(client, prompt: list[int], max_tokens: int = 4):
    return client.complete(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0,
                           ignore_eos=True)  # fmt: skip


def test_requests_sharing_a_prefix_land_where_it_is_cached(cluster, client):
    p, q = tokens(1, 10 * BS), tokens(2, 10 * BS)  # two prefixes of 10 full blocks
    before = scrape(cluster)
    # at once: the second goes to the other instance (fewer unfinished requests), so
    # each instance ends up holding one of the prefixes
    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(lambda x: complete(client, x, 24), [p + [7, 8, 9], q + [7, 8, 9]]))
    home = {"p": first[0].timings.instances[0], "q": first[1].timings.instances[0]}
    assert home["p"] != home["q"], home
    runs = []
    for round_ in range(2):
        for name, prefix in (("q", q), ("p", p)):
            tail = tokens(100 + round_, 5)
            done = complete(client, prefix + tail)
            assert done.timings.instances == [home[name]], (name, round_)
            # the 10 blocks of the prefix; the tail's partial block is computed
            assert done.cached_tokens == 10 * BS and done.prompt_tokens == 10 * BS + 5
            runs.append((home[name], done))
    assert f"prompt {10 * BS + 5} tokens ({10 * BS} cached), " in _summary("router", done)
    after = scrape(cluster)
    for inst in home.values():
        mine = [d for i, d in runs if i == inst] + [
            f for f in first if f.timings.instances == [inst]
        ]
        hits = delta(
            before, after, "instance_prefix_cache_hits_total", instance=inst, role="colocated"
        )
        queries = delta(
            before, after, "instance_prefix_cache_queries_total", instance=inst, role="colocated"
        )
        assert hits == sum(d.cached_tokens for d in mine) == 2 * 10 * BS
        assert queries == sum(d.prompt_tokens for d in mine)


def test_cached_tokens_in_openai_usage_streaming_and_not(cluster, chat_model):
    api = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused")
    try:
        prompt = tokens(3, 6 * BS + 3)
        for attempt in range(2):  # the first computes the prompt, the second reuses it
            got = api.completions.create(
                model=chat_model, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True}
            )
            cached = got.usage.prompt_tokens_details.cached_tokens
            assert cached == (0 if attempt == 0 else 6 * BS)
        # the same chat twice, streamed: the second hits every full block of its prompt
        # but the one of its last token
        messages = [{"role": "user", "content": "Tell me about caches. " * 8}]
        for _ in range(2):
            chunks = list(
                api.chat.completions.create(
                    model=chat_model,
                    messages=messages,
                    max_tokens=3,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
            )
            usage = chunks[-1].usage
        assert usage.prompt_tokens > 4 * BS
        assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BS * BS
    finally:
        api.close()
