"""Speculative decoding (``<pool>.speculative``, engine/speculative.py) through real
clusters: greedy and seeded sampled streams equal the offline engine without
speculation, token for token, co-located, disaggregated over gloo and over gRPC to a
decode instance of tensor-parallel degree 2 guessing by suffix decoding, and hybrid,
the decode pool verifying guesses (tests/cluster/test_supervision.py: after migration);
each stream's final timings report its guesses, and the instances' totals (/metrics) sum
them; every block is free after."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.cluster.helpers import seconds_until_blocks_free, small_cluster_config
from tests.cluster.test_disagg import disagg_config

PROMPTS = [[7, 8, 9, 10] * 6, [40 + i % 13 for i in range(90)], [3, 5] * 20 + [200, 201]]


@pytest.mark.parametrize("mode", ["colocated", "gloo", "grpc-decode-tp2", "hybrid"])
def test_greedy_streams_equal_the_plain_engine(chat_model, mode, on_shared_ray):
    from pdserve.cluster import launch

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(chat_model).generate(PROMPTS, params)]
    sampled = dict(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True)
    want_sampled = LLM(chat_model).generate(PROMPTS[:1], SamplingParams(**sampled))[0].token_ids
    if mode == "colocated":
        config = small_cluster_config(chat_model)
        pool = config["colocated"]
    else:
        backend = mode.split("-")[0]
        transport = "gloo" if backend == "hybrid" else backend
        config = disagg_config(chat_model, transport, transport == "gloo", 1)
        if backend == "hybrid":  # a tiny TPOT objective: prompts go local and remote both
            config.update(mode="hybrid", slo={"ttft_ms": 60_000, "tpot_ms": 0.001})
        config["prefill"]["resources"] = {"num_cpus": 0.5}
        pool = config["decode"]
        pool.update(resources={"num_cpus": 0.5}, tensor_parallel=2 if "tp2" in mode else 1)
    pool["speculative"] = {"method": "suffix" if "tp2" in mode else "ngram", "num_tokens": 4}
    with launch(config) as cluster, cluster.client() as client:
        guessed = accepted = 0
        for prompt, tokens in zip(PROMPTS, want, strict=True):
            done = client.complete(
                prompt_token_ids=prompt, max_tokens=40, temperature=0, ignore_eos=True
            )
            assert done.token_ids == tokens
            t = done.timings
            assert 0 <= t.accepted_tokens <= t.guessed_tokens and t.guess_steps <= 39
            guessed, accepted = guessed + t.guessed_tokens, accepted + t.accepted_tokens
        assert guessed > 0  # the repeated spans drew guesses
        done = client.complete(prompt_token_ids=PROMPTS[0], **sampled)
        assert done.token_ids == want_sampled
        guessed += done.timings.guessed_tokens
        accepted += done.timings.accepted_tokens
        pool_role = "colocated" if mode == "colocated" else "decode"
        stats = [i for i in cluster.stats()["instances"] if i["role"] == pool_role]
        assert sum(i["guessed_tokens_total"] for i in stats) == guessed
        assert sum(i["accepted_tokens_total"] for i in stats) == accepted
        seconds_until_blocks_free(cluster)
