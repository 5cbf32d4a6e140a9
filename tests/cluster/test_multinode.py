"""pdserve on a Ray cluster of several nodes (docs/serving.md, "Running across nodes").

Real ``ray start`` processes on one host, each node on its own loopback address (Ray
turns a ``--node-ip-address`` of 127.0.0.1 into the host's address, but keeps any other
127.x address), its own temporary folder, resources and labels, and token auth with a
token made here: a head (no CPUs: nothing but the driver's actors lands there), node A
(``pool=prefill`` and the custom resource ``pool_prefill``) and node B (``pool=decode``).
``pdserve up`` (a real CLI process) joins the head. Asserted: through Ray's node ids
(placement groups) and the nodes' process trees, prefill runs on A, decode on B, the
router and the supervisor on the head; the KV endpoints listen on their node's address;
greedy streams equal the offline engine over gRPC and gloo; SIGKILL of node B's raylet
with streams in flight: decode is ejected, restarted on a new ``pool=decode`` node once
one joins, and every stream completes exactly; SIGINT stops ``pdserve up`` cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from engine import LLM, SamplingParams
from router.client import RouterClient
from tests.cluster.helpers import wait_until
from tests.cluster.ray_probe import RayProbe
from tests.router.pdserve_up import pdserve_up

HEAD, NODE_A, NODE_B, SPARE = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
TOKEN = secrets.token_hex(32)
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
# Ray's own failure detection, sped up for the test: the GCS counts a node dead after 3
# failed health checks 1 s apart (a raylet that answers late still has 10 s each).
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 40, 90)]
SHORT, LONG = 16, 400  # tokens streamed; LONG: still streaming when the node is lost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayNode:
    """One ``ray start --block`` process and the processes it starts (Ray's workers take
    process groups of their own, so they are followed by pid), and its temporary folder."""

    ip: str
    proc: subprocess.Popen
    temp_dir: str
    seen: set[int] = field(default_factory=set)  # pids of this node's processes, ever

    def processes(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen.update(p.pid for p in found)
        return found

    def actor_pids(self, prefix: str) -> list[int]:
        """Processes of this node whose title starts with ``ray::<prefix>``."""
        found = []
        for p in self.processes():
            try:
                if " ".join(p.cmdline()).startswith(f"ray::{prefix}"):
                    found.append(p.pid)
            except psutil.NoSuchProcess:
                continue
        return found

    def alive(self) -> list[int]:
        """Pids of this node's processes that still run."""
        self.processes()
        pids = [self.proc.pid, *self.seen]
        return [p for p in pids if psutil.pid_exists(p) and not _zombie(p)]

    def kill(self) -> None:
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class RayNodes:
    def __init__(self):
        self.base = tempfile.mkdtemp(prefix="pdm-", dir="/tmp")  # short: Ray's socket paths
        self.port = _free_port()
        self.nodes: dict[str, RayNode] = {}
        self.decode: RayNode | None = None  # the node labelled pool=decode that is up
        self.probe: RayProbe | None = None  # Ray's view of the cluster

    def start(self, name: str, ip: str, cpus: int, resources=None, labels=None) -> RayNode:
        ports = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                 "runtime-env-agent-port", "metrics-export-port")  # fmt: skip
        args = ["ray", "start", "--block", "--node-ip-address", ip, "--num-cpus", str(cpus),
                "--temp-dir", f"{self.base}/{name}", "--object-store-memory", str(80 * 2**20),
                "--disable-usage-stats"]  # fmt: skip
        args += [x for p in ports for x in (f"--{p}", str(_free_port()))]
        if name == "head":
            args += ["--head", "--port", str(self.port), "--include-dashboard", "false",
                     "--ray-client-server-port", str(_free_port())]  # fmt: skip
        else:
            args += ["--address", f"{HEAD}:{self.port}"]
        if resources:
            args += ["--resources", json.dumps(resources)]
        if labels:
            args += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        log = open(f"{self.base}/{name}.log", "w")  # noqa: SIM115 (the node's lifetime)
        proc = subprocess.Popen(args, env={**os.environ, **AUTH, **FAST_HEALTH}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.nodes[name] = RayNode(ip, proc, f"{self.base}/{name}")
        return self.nodes[name]

    def node_ids(self) -> dict[str, str]:
        """Ray's id of each alive node, by address."""
        return {n["ip"]: n["id"] for n in self.probe.nodes()}

    def logs(self) -> str:
        """The last lines of every node's ``ray start`` output, for a failure."""
        return "\n".join(
            f"--- {name}:\n"
            + "".join(Path(f"{self.base}/{name}.log").read_text().splitlines(True)[-15:])
            for name in self.nodes
        )

    def stop(self) -> None:
        if self.probe is not None:
            self.probe.close()
        for node in reversed(self.nodes.values()):
            node.kill()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes():
    """The head, node A (prefill) and node B (decode), and a probe of Ray's view of them.
    Every process started here is killed at the end."""
    cluster = RayNodes()
    try:
        cluster.start("head", HEAD, 0)
        cluster.start("a", NODE_A, 1, {"pool_prefill": 1}, {"pool": "prefill"})
        cluster.decode = cluster.start("b", NODE_B, 1, labels={"pool": "decode"})
        cluster.probe = RayProbe(f"{HEAD}:{cluster.port}", {**os.environ, **AUTH})
        assert wait_until(lambda: len(cluster.node_ids()) == 3, 60, 0.5), cluster.logs()
        yield cluster
    finally:
        cluster.stop()
        assert wait_until(lambda: not [p for n in cluster.nodes.values() for p in n.alive()], 30)


@pytest.fixture(scope="module")
def expected(chat_model) -> list[list[int]]:
    """The offline engine's greedy tokens for each prompt (a shorter run: a prefix)."""
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    return [out.token_ids for out in LLM(chat_model).generate(PROMPTS, params)]


def multinode_config(model: str, port: int, backend: str) -> dict:
    pool = {"instances": 1, "max_batch_tokens": 128, "kv_blocks": 256, "block_size": 16}
    return {
        "model": model,
        "mode": "disaggregated",
        "ray": {"address": f"{HEAD}:{port}"},
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
    pids = {"prefill": a.actor_pids("PrefillWorker"), "decode": decode.actor_pids("DecodeWorker")}
    assert len(pids["prefill"]) == 1 and len(pids["decode"]) == 1, pids
    assert len(decode.actor_pids("DecodeRank")) == 1
    assert head.actor_pids("RouterServer") and head.actor_pids("Supervisor")
    (pid,) = pids["decode"]  # its KV receiver listens on the node's address
    listening = {c.laddr.ip for c in psutil.Process(pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}  # fmt: skip
    assert decode.ip in listening, listening
    return pids


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
        multinode_config(chat_model, cluster.port, backend), tmp_path, AUTH, signal.SIGINT
    )


def stopped_cleanly(served, pids: list[int]) -> None:
    assert served.exit_code == 0, "".join(served.output[-30:])
    assert "pdserve: stopped" in "".join(served.output)
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 30), pids


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
        new_pids = check_placement(nodes, nodes.decode)
        assert new_pids["prefill"] == pids["prefill"]
        client.close()
    stopped_cleanly(served, [*new_pids["prefill"], *new_pids["decode"]])
