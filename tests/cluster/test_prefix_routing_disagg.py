"""Cache-aware routing of the prefill choice on a real disaggregated cluster (two prefill
instances and one decode instance of the tiny chat model, gloo, ``router.policy:
cache_aware``): requests sharing a long prefix go to the prefill instance whose prefix
cache holds it, which reports its hit as the request's cached tokens and whose
``/metrics`` counters show the hits (the co-located side:
tests/cluster/test_prefix_routing.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.cluster.test_disagg import disagg_config
from tests.cluster.test_prefix_routing import BS, complete, tokens
from tests.cluster.test_router_metrics import delta, scrape


@pytest.fixture(scope="module")
def cluster(chat_model):
    from pdserve.cluster import launch

    config = disagg_config(chat_model, "gloo", True, 2)
    config["router"]["policy"] = "cache_aware"
    c = launch(config)
    yield c
    c.shutdown(drain=False)


def test_requests_sharing_a_prefix_go_to_the_prefill_instance_holding_it(cluster, chat_model):
    from pdserve.engine import LLM, SamplingParams

    client = cluster.client()
    p, q = tokens(11, 10 * BS), tokens(12, 10 * BS)
    before = scrape(cluster)
    # at once: the second goes to the other prefill instance (fewer unfinished requests)
    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(lambda x: complete(client, x, 24), [p + [7, 8, 9], q + [7, 8, 9]]))
    home = {"p": first[0].timings.instances[0], "q": first[1].timings.instances[0]}
    assert home["p"] != home["q"] and all(h.startswith("prefill-") for h in home.values())
    offline = LLM(chat_model, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, (name, prefix) in enumerate((("q", q), ("p", p), ("q", q), ("p", p))):
        prompt = prefix + tokens(100 + i, 5)
        done = complete(client, prompt)
        assert done.timings.instances == [home[name], "decode-0"], name
        assert done.cached_tokens == 10 * BS  # the prefill instance's hit, reported
        assert done.token_ids == offline.generate(prompt, greedy)[0].token_ids  # KV reused
    after = scrape(cluster)
    for inst in home.values():
        hits = delta(
            before, after, "instance_prefix_cache_hits_total", instance=inst, role="prefill"
        )
        assert hits == 2 * 10 * BS, inst
    client.close()
