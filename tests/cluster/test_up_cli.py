"""``pdserve up`` as a user runs it: serves, answers ``pdserve generate``, and on SIGTERM
drains in-flight requests and stops every process it started; when its router dies,
it serves on (Ray restarts the router, its keeper starts it on the same address) and
still stops cleanly on SIGTERM; when it is killed itself, the embedded Ray's head ends
with it, and every actor with that (the detached instances too)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import yaml

from pdserve.router.client import RouterClient
from tests.cluster.helpers import ray_temp_dirs, small_cluster_config, wait_until

ROOT = Path(__file__).resolve().parents[2]
ACTORS = ("EngineWorker", "Supervisor", "RouterServer")


def _health(client: RouterClient) -> str:
    try:
        return client.health()
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        return "gone"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _actors(session: int) -> dict[int, str]:
    """pdserve's actor processes in session ``session`` (Ray gives each worker a process
    group of its own, in the session of the process that started Ray): pid -> class,
    from the title Ray gives them (``ray::EngineWorker``, ``ray::Supervisor.ping``)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            title = (entry / "cmdline").read_text().split("\0")[0].strip()
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        actor = title.removeprefix("ray::").split(".")[0]
        if int(fields[3]) == session and fields[0] not in ("Z", "X") and actor in ACTORS:
            found[int(entry.name)] = actor
    return found


@pytest.fixture
def up(tmp_path, chat_model):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(small_cluster_config(chat_model)))
    ray_base = tempfile.mkdtemp(prefix="pdt-", dir="/tmp")  # short: Ray's socket paths
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cluster.cli", "up", str(path), "--set", "router.port=0"],
        cwd=ROOT,
        env={**os.environ, "PDSERVE_RAY_TMPDIR": ray_base},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: Ray's processes join it
    )
    lines = []
    deadline = time.monotonic() + 180
    found = None
    while found is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(r"router listening on (\S+) \(pid (\d+),", line)
    assert found, "".join(lines)
    yield proc, found.group(1), ray_base, int(found.group(2))
    if _group_alive(proc.pid):  # `up`, or what outlives a killed one (Ray's agents)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    shutil.rmtree(ray_base, ignore_errors=True)


def test_up_serves_then_drains_on_sigterm_and_stops_everything(up):
    proc, address, ray_base, _ = up
    client = RouterClient(address)
    assert client.health() == "SERVING"

    gen = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "generate", "--router", address, "Hi",
         "--max-tokens",
         "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert re.search(r"prompt 2 tokens, TTFT \d+ ms, 5 tokens, .* finish length\]", gen.stdout)

    stream = client.generate(prompt_token_ids=[4] * 30, max_tokens=900, ignore_eos=True)
    got = len(next(stream).token_ids)
    proc.send_signal(signal.SIGTERM)
    # draining: NOT_SERVING until the stream ends; a tiny model may finish the stream
    # before a loaded host polls, and then the drained router is already gone
    assert wait_until(lambda: _health(client) in ("NOT_SERVING", "gone"), timeout_s=10)
    with pytest.raises(grpc.RpcError) as err:
        client.complete("late", max_tokens=1)
    if err.value.code() == grpc.StatusCode.CANCELLED:  # it met the drained router closing
        assert wait_until(lambda: _health(client) == "gone", timeout_s=10), err.value
    else:
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert got + sum(len(c.token_ids) for c in rest) == 900
    client.close()

    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "draining in-flight requests" in out and "pdserve: stopped" in out
    # the router, the engine instances and Ray's own processes are all gone
    assert wait_until(lambda: not _group_alive(proc.pid), timeout_s=15)
    assert ray_temp_dirs(ray_base) == []


def test_up_serves_on_when_its_router_dies(up):
    proc, address, ray_base, router_pid = up
    killed = time.monotonic()
    os.kill(router_pid, signal.SIGKILL)  # a real signal to the router actor's process
    # a new router process answers on the same address within seconds; `up` runs on
    with RouterClient(address) as client:
        assert wait_until(lambda: _health(client) == "SERVING", timeout_s=30)
        assert time.monotonic() - killed < 30
        got = client.complete(prompt_token_ids=[4, 5, 6], max_tokens=3, temperature=0)
        assert got.finish_reason == "length"
    routers = [pid for pid, actor in _actors(proc.pid).items() if actor == "RouterServer"]
    assert len(routers) == 1 and routers[0] != router_pid, routers
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "pdserve: stopped" in out, out
    assert wait_until(lambda: not _group_alive(proc.pid), timeout_s=15)
    assert ray_temp_dirs(ray_base) == []


def test_a_killed_up_takes_the_embedded_ray_and_every_actor_with_it(up):
    proc, address, _, router_pid = up
    with RouterClient(address) as client:
        assert client.health() == "SERVING"
    started = _actors(proc.pid)  # `up` leads its own session
    assert sorted(started.values()) == ["EngineWorker", "EngineWorker", "RouterServer",
                                        "Supervisor"], started  # fmt: skip
    assert started[router_pid] == "RouterServer"
    proc.kill()  # `up` alone, by a real SIGKILL: no shutdown runs
    proc.wait(timeout=30)
    assert wait_until(lambda: not _actors(proc.pid), timeout_s=60), _actors(proc.pid)
