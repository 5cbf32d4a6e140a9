"""The KV plane of a loopback disaggregated cluster is closed (docs/kv_transfer.md,
"Closed by default"). One cluster per backend, with tensor-parallel instances (gloo:
decode TP 2; grpc: prefill TP 2), serves both checks:

- every listener is on loopback: every listening socket of every process of the
  cluster (the driver, the router, the supervisor, every rank of every instance),
  listed with psutil, is on 127.0.0.0/8 or ::1 but one per process, Ray's own: its core
  worker's gRPC server, which Ray 2.60 binds to ``::`` whatever ``_node_ip_address``
  says (and advertises as the machine's address). That one is excluded by its port,
  read from the process's own Ray core worker (the owner address of an object it puts),
  and required to be there, so nothing else can hide behind it; and the router's ports
  cannot be bound beside it (SO_REUSEPORT);
- an outsider changes nothing: while six long greedy streams run, a separate OS process
  without the secret (tests/cluster/kv_attacker.py) attacks, on gloo, the decode
  instance's KV rendezvous and its tensor-parallel world's: torch's store client reads
  the card and the TP keys (to pose as the receiver), pops the joins, overwrites the
  card, pushes a spoofed join and floods 64 values of 4 MiB; made-up proofs each
  followed by 4 MiB, and 80 connections that never answer. On grpc it pushes to a live
  transfer token (read from inside the decode instance, which an outsider could not do)
  and 100 bogus ones. Every stream equals the offline output, the live reservation is
  untouched, every attempt was refused, no byte past a challenge reached the attacker,
  the decode process grew less than 32 MiB (gloo) and every block is free after."""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import ray

from pdserve.engine import LLM, SamplingParams
from pdserve.instance.messages import Attempt
from pdserve.kv_transfer import KVDestination
from tests.cluster.helpers import wait_until
from tests.cluster.test_disagg import (
    check_pools,
    disagg_config,
    greedy_outputs,
    run_concurrently,
    workload,
)

ROOT = Path(__file__).resolve().parents[2]
# the decode process may grow this much while it serves the streams under attack
RSS_BOUND = {"gloo": 32 << 20, "grpc": 64 << 20}
SETUPS = {"gloo": (1, 2), "grpc": (2, 1)}  # backend: (prefill TP, decode TP)


@pytest.fixture(scope="module", params=sorted(SETUPS))
def closed(request, chat_model):
    """(backend, prefill TP, decode TP, the cluster)."""
    from pdserve.cluster import launch

    backend = request.param
    prefill_tp, decode_tp = SETUPS[backend]
    config = disagg_config(chat_model, backend, True, 1)
    config["prefill"].update(tensor_parallel=prefill_tp, resources={"num_cpus": 0.5})
    config["decode"].update(tensor_parallel=decode_tp, resources={"num_cpus": 0.5})
    with launch(config) as cluster:
        yield backend, prefill_tp, decode_tp, cluster


@pytest.fixture(scope="module")
def long_streams(chat_model):
    work = [([3 + (7 * i + j) % 250 for j in range(40 + 13 * i)], 320) for i in range(6)]
    return work, greedy_outputs(LLM(chat_model), work)


def _processes(cluster) -> dict[int, tuple[str, int]]:
    """pid: (which process, the port of its Ray core worker's own server)."""

    def ray_port(_actor=None) -> tuple[int, int]:
        import os

        import ray
        from ray.core.generated.common_pb2 import Address

        core = ray._private.worker.global_worker.core_worker
        return os.getpid(), Address.FromString(core.get_owner_address(ray.put(0))).port

    actors = {"router": cluster.router, "supervisor": cluster.supervisor}
    for name in cluster.workers:
        h = cluster.handles(name)
        actors.update({f"{name} rank {r}": a for r, a in enumerate([h.worker, *h.ranks])})
    out = {}
    for who, actor in actors.items():
        pid, port = ray.get(actor.__ray_call__.remote(ray_port), timeout=30)
        out[pid] = (who, port)
    pid, port = ray_port()
    out[pid] = ("driver", port)
    return out


def _listening(pid: int) -> list[tuple[str, int]]:
    conns = psutil.Process(pid).net_connections(kind="inet")
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def _inside(handle, fn):
    """``fn(actor)`` run inside the actor: what an outsider cannot do."""
    return ray.get(handle.__ray_call__.remote(fn), timeout=30)


def test_every_listener_is_on_loopback(closed):
    _, prefill_tp, decode_tp, cluster = closed
    streams = run_concurrently(cluster.client(), workload(4, seed=5))
    assert all(chunks[-1].finish_reason == "length" for chunks in streams)
    procs = _processes(cluster)
    assert len(procs) == 3 + prefill_tp + decode_tp  # driver, router, supervisor, ranks
    wide, ours = {}, {}
    for pid, (who, ray_port) in procs.items():
        sockets = _listening(pid)
        assert ray_port in [port for _, port in sockets], (who, ray_port, sockets)
        ours[who] = [a for a in sockets if a[1] != ray_port]
        wide[who] = [a for a in ours[who] if not _loopback(a[0])]
    assert not any(wide.values()), wide
    # the sockets checked are there: the decode ranks' KV receivers, the TP stores
    tp_rank0 = "decode-0 rank 0" if decode_tp > 1 else "prefill-0 rank 0"
    assert ours["decode-0 rank 0"] and ours[tp_rank0] and ours["router"], ours
    # one router: its ports are its own (no SO_REUSEPORT, which gRPC would turn on), so
    # no other process of the user can bind beside it and take a share of its clients
    for address in (cluster.address, cluster.http_address):
        host, port = address.rsplit(":", 1)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError) as taken:
                s.bind((host, int(port)))
            assert taken.value.errno == errno.EADDRINUSE
    check_pools(cluster)


def test_outsider_without_the_secret_changes_nothing(closed, long_streams):
    backend, _, _, cluster = closed
    work, want = long_streams
    decode = cluster.handles("decode-0").worker
    address = ray.get(decode.ready.remote(), timeout=30)["kv_addresses"][0]
    pid = ray.get(decode.ping.remote(), timeout=30)["pid"]
    probe = Attempt("probe#1", tuple(range(3, 40)), SamplingParams(max_tokens=1), "test")
    token = KVDestination.from_bytes(ray.get(decode.reserve.remote(probe), timeout=30)).token
    host = address.rsplit(":", 1)[0]
    tp_address = f"{host}:{_inside(decode, lambda w: w._store.port)}" if backend == "gloo" else ""
    rss = psutil.Process(pid).memory_info().rss

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    attacker = subprocess.Popen(
        [sys.executable, "-m", "tests.cluster.kv_attacker", backend, address, "prefill-0",
         token, tp_address],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert attacker.stdout.readline().strip() == "ready"
        client, streams = cluster.client(), []
        runner = threading.Thread(target=lambda: streams.extend(run_concurrently(client, work)))
        runner.start()
        assert wait_until(lambda: cluster.stats()["in_flight"] >= len(work) // 2, 30)
        assert runner.is_alive()  # the streams are in flight when the attack starts
        out, err = attacker.communicate("go\n", timeout=180)
    finally:
        attacker.kill()
    assert attacker.returncode == 0, err[-2000:]
    got = json.loads(out.splitlines()[-1])
    runner.join(timeout=240)
    assert not runner.is_alive()

    for chunks, tokens in zip(streams, want, strict=True):
        assert [t for c in chunks for t in c.token_ids] == tokens
    if backend == "gloo":
        for plane in ("kv", "tp"):
            refusals = {k: v for k, v in got[plane].items() if isinstance(v, str)}
            assert all(v.startswith("refused") for v in refusals.values()), (plane, got)
            assert got[plane]["after_challenge"] == 0, (plane, got)
        tp_refused = _inside(decode, lambda w: w._store.refused)
        assert tp_refused >= 101, tp_refused
    else:
        assert got == {"live_token": "REJECTED", "bogus": ["REJECTED"]}
    refused = _inside(decode, lambda w: w.components[0].receiver.refused)
    assert refused >= 101, refused
    state = _inside(decode, lambda w: w.components[0].receiver.state("probe#1").value)
    assert state == "reserved"  # the live reservation was not touched
    grown = psutil.Process(pid).memory_info().rss - rss
    print(f"{backend}: {refused} attempts refused; the decode process grew {grown / 2**20:.1f} MiB")
    assert grown < RSS_BOUND[backend], f"decode process grew by {grown >> 20} MiB"
    ray.get(decode.abort.remote(["probe#1"]), timeout=30)
    check_pools(cluster)
