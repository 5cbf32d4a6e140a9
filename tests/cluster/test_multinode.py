"""pdserve on a Ray cluster of several nodes (docs/serving.md, "Running across nodes").

Real ``ray start`` processes on one host (tests/cluster/ray_nodes.py), each node on its
own loopback address with its own temporary folder, resources and labels, token auth: a
head (no CPUs: nothing but the driver's actors lands there), node A (``pool=prefill`` and
the custom resource ``pool_prefill``) and node B (``pool=decode``). ``pdserve up`` (a
real CLI process) joins the head. Asserted: a pool no node can hold fails the start in
bound, naming it; through Ray's node ids (placement groups) and the nodes' process trees,
prefill runs on A, decode (2 ranks) on B, the router and the supervisor on the head;
decode's KV endpoint listens on its node's address; greedy streams equal the offline
engine over gRPC and gloo; SIGKILL of node B's raylet with streams in flight: decode is
ejected, restarted on a new ``pool=decode`` node once one joins, and every stream
completes exactly; SIGINT stops ``pdserve up`` cleanly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from pdserve.engine import LLM, SamplingParams
from pdserve.router.client import RouterClient
from tests.cluster.helpers import wait_until
from tests.cluster.ray_nodes import AUTH, RayNode, RayNodes
from tests.router.pdserve_up import ROOT, pdserve_up

HEAD, NODE_A, NODE_B, SPARE = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 40, 90)]
SHORT, LONG = 16, 400  # tokens streamed; LONG: still streaming when the node is lost


@pytest.fixture(scope="module")
def expected(chat_model) -> list[list[int]]:
    """The offline engine's greedy tokens for each prompt (a shorter run: a prefix)."""
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    return [out.token_ids for out in LLM(chat_model).generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def nodes(request):
    """The head, node A (prefill) and node B (decode), and a probe of Ray's view of them
    (``expected`` is computed while they start). Every process started here is killed at
    the end."""
    cluster = RayNodes(HEAD)
    try:
        cluster.start("head", HEAD, 0)
        cluster.start("a", NODE_A, 1, {"pool_prefill": 1}, {"pool": "prefill"})
        cluster.decode = cluster.start("b", NODE_B, 1, labels={"pool": "decode"})
        request.getfixturevalue("expected")
        cluster.start_probe()
        assert wait_until(lambda: len(cluster.node_ids()) == 3, 60, 0.5), cluster.logs()
        yield cluster
    finally:
        cluster.stop()
        assert wait_until(lambda: not [p for n in cluster.nodes.values() for p in n.alive()], 30)


def multinode_config(model: str, address: str, backend: str) -> dict:
    pool = {"instances": 1, "max_batch_tokens": 128, "kv_blocks": 256, "block_size": 16}
    return {
        "model": model,
        "mode": "disaggregated",
        "ray": {"address": address},
        "router": {"host": "127.0.0.1", "port": 0, "http_port": 0},
        "prefill": {**pool, "resources": {"num_cpus": 1, "custom": {"pool_prefill": 1}},
                    "node_labels": {"pool": "prefill"}},
        "decode": {**pool, "tensor_parallel": 2, "resources": {"num_cpus": 0.5},
                   "node_labels": {"pool": "decode"}},
        "kv_transfer": {"backend": backend, "lease_s": 5},
        "supervisor": {"unresponsive_s": 3},
    }  # fmt: skip


def group_nodes(cluster: RayNodes, name: str) -> set[str]:
    """Ray node ids of the bundles of instance ``name``'s placement group."""
    groups = cluster.probe.groups()
    (group,) = [g for g in groups if g["name"] == f"pdserve-{name}" and g["state"] == "CREATED"]
    return set(group["nodes"])


def check_placement(cluster: RayNodes, decode: RayNode) -> dict[str, list[int]]:
    """Prefill on node A, decode (both ranks) on ``decode``, the router and the
    supervisor on the head; decode's KV endpoint on its node's address. The instances' pids."""
    head, a = cluster.nodes["head"], cluster.nodes["a"]
    ids = cluster.node_ids()
    assert group_nodes(cluster, "prefill-0") == {ids[NODE_A]}
    assert group_nodes(cluster, "decode-0") == {ids[decode.ip]}
    # one worker class and one rank class serve every role; each node holds one instance
    pids = {"prefill": a.actor_pids("EngineWorker"), "decode": decode.actor_pids("EngineWorker"),
            "rank1": decode.actor_pids("RankActor")}  # fmt: skip
    assert all(len(p) == 1 for p in pids.values()), pids
    assert head.actor_pids("RouterServer") and head.actor_pids("Supervisor")
    assert decode.ip in listening(pids["decode"][0])  # its KV receiver, on its node's address
    return pids


def listening(pid: int) -> set[str]:
    """The addresses a process listens on (TCP)."""
    connections = psutil.Process(pid).net_connections("tcp")
    return {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}


async def _streams(client: RouterClient, max_tokens: int, on_first=None) -> list[list]:
    """Every prompt streamed at once; ``on_first`` runs once each has its first token."""
    started = asyncio.Event()
    firsts = 0

    async def one(ids):
        nonlocal firsts
        chunks = []
        async for chunk in client.agenerate(
            prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
        ):
            chunks.append(chunk)
            if len(chunks) == 1:
                firsts += 1
                if firsts == len(PROMPTS):
                    started.set()
        return chunks

    tasks = [asyncio.ensure_future(one(ids)) for ids in PROMPTS]
    if on_first is not None:
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.get_running_loop().run_in_executor(None, on_first)
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        await client.aclose()


def tokens(chunks: list) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def serve(cluster, chat_model, tmp_path, backend):
    return pdserve_up(
        multinode_config(chat_model, cluster.address, backend), tmp_path, AUTH, signal.SIGINT
    )


def stopped_cleanly(served, pids: list[int]) -> None:
    assert served.exit_code == 0, "".join(served.output[-30:])
    assert "pdserve: stopped" in "".join(served.output)
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 30), pids


def test_a_pool_no_node_can_hold_fails_the_start_naming_it(nodes, chat_model, tmp_path):
    config = multinode_config(chat_model, nodes.address, "grpc")
    config["prefill"]["node_labels"] = {"pool": "nowhere"}  # the first pool started
    config["supervisor"]["placement_timeout_s"] = 2
    path = tmp_path / "nowhere.yaml"
    path.write_text(yaml.safe_dump(config))
    up = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "up", str(path)],
        cwd=ROOT, env={**os.environ, **AUTH}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert up.returncode == 1, up.stdout + up.stderr
    assert (
        "pdserve up: could not start the cluster: instance prefill-0: no node could hold pool "
        "prefill: 1 bundle(s) of {'CPU': 1.0, 'pool_prefill': 1.0} on one node labelled "
        "{'pool': 'nowhere'} (STRICT_PACK) within 2 s (supervisor.placement_timeout_s); "
        "alive nodes: "
    ) in up.stderr, up.stderr
    assert f"{NODE_A} {{'CPU': 1.0, 'pool_prefill': 1.0}} labels {{'pool': 'prefill'}}" in up.stderr
    assert not [g for g in nodes.probe.groups() if g["state"] == "CREATED"]


def test_grpc_pools_on_their_nodes_stream_greedy(nodes, expected, chat_model, tmp_path):
    with serve(nodes, chat_model, tmp_path, "grpc") as served:
        pids = check_placement(nodes, nodes.decode)
        got = asyncio.run(_streams(RouterClient(served.address), SHORT))
        assert [tokens(c) for c in got] == [e[:SHORT] for e in expected]
        assert all(c[-1].timings.instances[-1] == "decode-0" for c in got)
    stopped_cleanly(served, [p for ps in pids.values() for p in ps])


def test_gloo_decode_node_lost_then_replaced(nodes, expected, chat_model, tmp_path):
    lost, spare_ip = nodes.decode, SPARE if nodes.decode.ip == NODE_B else NODE_B
    with serve(nodes, chat_model, tmp_path, "gloo") as served:
        pids = check_placement(nodes, lost)
        client = RouterClient(served.address)
        got = asyncio.run(_streams(client, SHORT))
        assert [tokens(c) for c in got] == [e[:SHORT] for e in expected]
        assert NODE_A in listening(pids["prefill"][0])  # gloo pairs, on the prefill node

        (raylet,) = [p.pid for p in lost.processes() if p.name() == "raylet"]
        killed = {}

        def kill_node_b():
            os.kill(raylet, signal.SIGKILL)  # the real raylet of the decode node
            killed["at"] = time.monotonic()
            nodes.decode = nodes.start(f"d{spare_ip[-1]}", spare_ip, 1, labels={"pool": "decode"})

        got = asyncio.run(_streams(client, LONG, on_first=kill_node_b))
        assert [tokens(c) for c in got] == expected  # no token lost or repeated
        for chunks in got:
            timings = chunks[-1].timings
            assert chunks[-1].finish_reason == "length"
            assert timings.attempts >= 2, timings  # migrated off the lost decode instance
        took = time.monotonic() - killed["at"]
        assert took < 60, took
        assert wait_until(lambda: not lost.alive(), 30), lost.alive()  # the node is gone
        nodes.start_probe()  # the old one may stall after the node loss (ray_nodes.py)
        new_pids = check_placement(nodes, nodes.decode)
        assert new_pids["prefill"] == pids["prefill"]
        client.close()
    stopped_cleanly(served, [p for ps in new_pids.values() for p in ps])
