"""A Ray driver in a process of its own that answers a test's questions about a running
Ray cluster: its nodes, and its placement groups with the nodes of their bundles.

A test process cannot simply join that cluster: Ray reads ``RAY_AUTH_MODE`` once, when
it is imported, and one process holds one Ray session. The probe is started with the
cluster's token in its environment and answers one JSON line per question (``nodes``,
``groups``) read on its stdin.

Run as ``python -m tests.cluster.ray_probe ADDRESS``.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "probe:"  # what starts an answer line (Ray may print lines of its own)


class RayProbe:
    """The probe's process; ``ask`` is bounded, ``close`` ends it."""

    def __init__(self, address: str, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster.ray_probe", address],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def ask(self, question: str, timeout_s: float = 60.0):
        self.proc.stdin.write(question + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            line = self.proc.stdout.readline() if ready else ""
            if ready and not line:
                raise RuntimeError(f"the Ray probe exited ({self.proc.wait()})")
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise TimeoutError(f"the Ray probe did not answer {question!r} in {timeout_s:g} s")

    def nodes(self) -> list[dict]:
        """Alive nodes: ``id``, ``ip``, ``labels``, ``resources``."""
        return self.ask("nodes")

    def groups(self) -> list[dict]:
        """Placement groups: ``name``, ``state`` and the node id of each bundle."""
        return self.ask("groups")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


def _answer(question: str):
    import ray

    if question == "nodes":
        return [
            {"id": n["NodeID"], "ip": n["NodeManagerAddress"], "labels": n.get("Labels", {}),
             "resources": n["Resources"]}
            for n in ray.nodes()
            if n["Alive"]
        ]  # fmt: skip
    if question == "groups":
        return [
            {"name": g["name"], "state": g["state"],
             "nodes": [g["bundles_to_node_id"].get(i) for i in range(len(g["bundles"]))]}
            for g in ray.util.placement_group_table().values()
        ]  # fmt: skip
    raise ValueError(f"unknown question {question!r}; allowed: nodes, groups")


def main(address: str) -> None:
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    for line in sys.stdin:
        print(MARK + json.dumps(_answer(line.strip())), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
