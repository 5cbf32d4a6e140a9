"""``cluster.launch`` on a real embedded Ray: named actors with their resources, the
standard health check, round-robin placement, and a clean stop. Tests that kill an
instance or drain have clusters of their own (tests/cluster/test_lifecycle.py)."""

from __future__ import annotations

import os
import tempfile
import time

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.cluster.helpers import ray_temp_dirs, small_cluster_config


@pytest.fixture(scope="module")
def cluster(chat_model):
    from pdserve.cluster import launch

    base = tempfile.mkdtemp(prefix="pdt-", dir="/tmp")  # short: Ray's socket paths
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_RAY_TMPDIR", base)
        c = launch(small_cluster_config(chat_model, policy="round_robin"))
    assert len(ray_temp_dirs(base)) == 1
    yield c
    c.shutdown(drain=False)
    assert not ray.is_initialized() and ray_temp_dirs(base) == []
    os.rmdir(base)


def health(address: str, service: str = "") -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_actors_are_named_by_role_and_index_in_the_pdserve_namespace(cluster):
    named = ray.util.list_named_actors(all_namespaces=True)
    assert sorted((a["namespace"], a["name"]) for a in named) == [
        ("pdserve", "colocated-0"),
        ("pdserve", "colocated-1"),
        ("pdserve", "router"),
        ("pdserve", "supervisor"),
    ]
    assert ray.get_actor("colocated-1", namespace="pdserve") is not None


def test_instances_hold_their_resources_and_limit_torch_threads(cluster):
    assert ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0) == 2
    assert [i["name"] for i in cluster.instances] == ["colocated-0", "colocated-1"]
    assert all(i["threads"] == 1 for i in cluster.instances)  # num_cpus 1
    assert len({i["pid"] for i in cluster.instances}) == 2
    assert all(i["max_context"] == 1024 and i["num_blocks"] == 512 for i in cluster.instances)


def test_the_router_and_the_instances_run_at_the_drivers_niceness(cluster):
    """Not Ray's default of 15 for its workers (cluster/ray_env.py): at 15, whatever else
    wakes on the node takes the CPU from an engine step."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    for pid in [i["pid"] for i in cluster.instances] + [cluster.router_pid()]:
        assert os.getpriority(os.PRIO_PROCESS, pid) == mine, f"pid {pid}"


def test_every_instance_has_a_placement_group_of_its_pool(cluster):
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert sorted((g["name"], g["strategy"]) for g in groups) == [
        ("pdserve-colocated-0", "STRICT_PACK"),
        ("pdserve-colocated-1", "STRICT_PACK"),
    ]
    assert all(g["bundles"] == {0: {"CPU": 1.0}} for g in groups)


def test_a_group_no_node_can_hold_fails_in_bound_naming_the_pool(cluster):
    from pdserve.cluster.config import PoolConfig, Resources
    from pdserve.cluster.placement_groups import PlacementError, create

    pool = PoolConfig(resources=Resources(num_cpus=0.5, custom={"pool_x": 1}),
                      node_labels={"pool": "nowhere"})  # fmt: skip
    started = time.monotonic()
    with pytest.raises(PlacementError) as err:
        create("decode-7", "decode", pool, timeout_s=1.0)
    assert time.monotonic() - started < 10
    assert str(err.value).startswith(
        "instance decode-7: no node could hold pool decode: 1 bundle(s) of "
        "{'CPU': 0.5, 'pool_x': 1} on one node labelled {'pool': 'nowhere'} (STRICT_PACK) "
        "within 1 s (supervisor.placement_timeout_s); alive nodes: "
    ), err.value
    cpus = ray.cluster_resources()["CPU"]
    assert f"{{'CPU': {cpus}" in str(err.value) and str(err.value).endswith("labels {}")
    (group,) = [g for g in ray.util.placement_group_table().values()
                if g["name"] == "pdserve-decode-7"]  # fmt: skip
    assert group["state"] == "REMOVED"


def test_health_reports_serving_after_start(cluster):
    assert health(cluster.address) == "SERVING"
    assert health(cluster.address, "pdserve.v1.Router") == "SERVING"


def test_round_robin_alternates_instances(cluster):
    client = cluster.client()
    served = [
        client.complete(prompt_token_ids=[5, 6, 7], max_tokens=2).timings.instances[0]
        for _ in range(4)
    ]  # where the cursor starts depends on the requests other tests sent
    assert served[:2] == served[2:] and sorted(served[:2]) == ["colocated-0", "colocated-1"]
