"""A Ray cluster of several nodes on one host, for tests: each node a ``ray start --block``
process of its own (own loopback address, temporary folder, resources, labels), all with
token auth, the token made here, and a probe of Ray's view of them
(tests/cluster/ray_probe.py).

Ray turns a ``--node-ip-address`` of 127.0.0.1 into the host's address but keeps any
other 127.x address, so each node gets one of its own: what a node advertises is then
told apart from what another does. Every process a node starts is followed by pid (Ray's
workers take process groups of their own) and killed by ``stop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.cluster.ray_probe import RayProbe

RAY = str(Path(sys.executable).parent / "ray")  # this venv's, whether or not it is on PATH

TOKEN = secrets.token_hex(32)
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
# Ray's own failure detection, sped up for tests: the GCS counts a node dead after 3
# failed health checks 1 s apart (a raylet that answers late still has 10 s each).
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


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
    def __init__(self, head: str):
        self.head = head  # the head's address
        self.base = tempfile.mkdtemp(prefix="pdm-", dir="/tmp")  # short: Ray's socket paths
        self.port = _free_port()
        self.nodes: dict[str, RayNode] = {}
        self.decode: RayNode | None = None  # the node labelled pool=decode that is up
        self.probe: RayProbe | None = None  # Ray's view of the cluster

    def start(self, name: str, ip: str, cpus: int, resources=None, labels=None) -> RayNode:
        ports = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                 "runtime-env-agent-port", "metrics-export-port")  # fmt: skip
        args = [RAY, "start", "--block", "--node-ip-address", ip, "--num-cpus", str(cpus),
                "--temp-dir", f"{self.base}/{name}", "--object-store-memory", str(80 * 2**20),
                "--disable-usage-stats", "--include-log-monitor", "false"]  # fmt: skip
        args += [x for p in ports for x in (f"--{p}", str(_free_port()))]
        if name == "head":
            args += ["--head", "--port", str(self.port), "--include-dashboard", "false",
                     "--ray-client-server-port", str(_free_port())]  # fmt: skip
        else:
            args += ["--address", self.address]
        if resources:
            args += ["--resources", json.dumps(resources)]
        if labels:
            args += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        log = open(f"{self.base}/{name}.log", "w")  # noqa: SIM115 (the node's lifetime)
        proc = subprocess.Popen(args, env={**os.environ, **AUTH, **FAST_HEALTH}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.nodes[name] = RayNode(ip, proc, f"{self.base}/{name}")
        return self.nodes[name]

    @property
    def address(self) -> str:
        return f"{self.head}:{self.port}"

    def start_probe(self) -> None:
        """A new probe (an old one is killed): a Ray driver that was connected while a
        node's raylet died can stall for a minute on its next call, so a test starts a
        new one after losing a node."""
        if self.probe is not None:
            self.probe.kill()
        self.probe = RayProbe(self.address, {**os.environ, **AUTH})

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
