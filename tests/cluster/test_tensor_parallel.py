"""Tensor-parallel instances on a real cluster: N Ray actors in a STRICT_PACK placement
group, one gloo world per instance. Outputs equal the offline engine's, co-located and
disaggregated with different degrees on the two sides, over gloo and gRPC; logprobs and
penalties (rank 0 samples, from the gathered logits) too."""

from __future__ import annotations

import pytest
import ray

from pdserve.engine import LLM, SamplingParams
from tests.cluster.helpers import all_blocks_free, wait_until
from tests.cluster.test_disagg import (
    LOGPROB_REQUESTS,
    check_logprobs,
    check_pools,
    disagg_config,
    run_concurrently,
    workload,
)


@pytest.fixture(scope="module")
def expected(kv4_model):
    """The offline engine's outputs (one rank): greedy tokens of the workload, and the
    tokens and logprobs of ``LOGPROB_REQUESTS`` (sampled on rank 0 of an instance)."""
    llm, work = LLM(kv4_model), workload(16, seed=3)
    outs = llm.generate(
        [ids for ids, _ in work],
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work],
    )
    logprobs = [llm.generate(ids, p)[0] for ids, p in LOGPROB_REQUESTS]
    return work, [o.token_ids for o in outs], logprobs


def _check(cluster, work, want, logprobs) -> None:
    client = cluster.client()
    streams = run_concurrently(client, work)
    for chunks, tokens in zip(streams, want, strict=True):
        assert [t for c in chunks for t in c.token_ids] == tokens
    check_logprobs(client, logprobs)
    assert wait_until(lambda: all_blocks_free(client.stats()), 10), client.stats()
    check_pools(cluster)
    client.close()


def test_colocated_tp2(kv4_model, expected, on_shared_ray):
    from pdserve.cluster import launch

    config = {
        "model": kv4_model,
        "mode": "colocated",
        "router": {"port": 0, "http_port": 0},
        "colocated": {
            "instances": 1,
            "tensor_parallel": 2,
            "max_batch_tokens": 64,
            "kv_blocks": 256,
            "resources": {"num_cpus": 0.5},
        },
    }
    with launch(config) as cluster:
        handles = cluster.handles("colocated-0")
        assert len(handles.ranks) == 1 and handles.group is not None
        info = cluster.instances[0]
        assert info["tensor_parallel"] == 2
        ranks = ray.util.placement_group_table(handles.group)
        assert ranks["strategy"] == "STRICT_PACK" and len(ranks["bundles"]) == 2
        _check(cluster, *expected)


# each backend once, each side at 2 ranks once; tests/cluster/test_prefix_handoff.py
# runs the other two pairings (and kv_transfer/test_head_mapping every one, no cluster)
@pytest.mark.parametrize("backend,prefill_tp,decode_tp", [("gloo", 2, 1), ("grpc", 1, 2)])
def test_disaggregated_with_different_degrees(
    kv4_model, expected, on_shared_ray, backend, prefill_tp, decode_tp
):
    from pdserve.cluster import launch

    # layer-wise sending over gloo, all layers after the pass over gRPC
    config = disagg_config(kv4_model, backend, backend == "gloo", 1)
    config["prefill"].update(tensor_parallel=prefill_tp, resources={"num_cpus": 0.5})
    config["decode"].update(tensor_parallel=decode_tp, resources={"num_cpus": 0.5})
    with launch(config) as cluster:
        _check(cluster, *expected)
