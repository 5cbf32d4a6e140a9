"""The grpc KV plane checks its peer before it gives a stream a thread (pdserve issue
39; docs/kv_transfer.md, "Closed by default"). A real disaggregated cluster on the grpc
backend, without and with mTLS (``kv_transfer.tls``, trustme's certificates): while six
long greedy streams run, a separate OS process without the secret (or the cluster's
certificate) holds 100 idle KV streams open, some of them opened with a forged proof
or one forged proof replayed (tests/cluster/kv_attacker.py ``idle``). Every stream equals
the offline output, every attacker stream is refused (REJECTED, or under mTLS its
handshake fails) without a KV byte or the receiver's proof coming back, the decode
process grows by less than 32 MiB, and every block is free after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import ray
import trustme

from pdserve.engine import LLM
from tests.cluster.helpers import wait_until
from tests.cluster.test_disagg import (
    check_pools,
    disagg_config,
    greedy_outputs,
    run_concurrently,
)

ROOT = Path(__file__).resolve().parents[2]
RSS_BOUND = 32 << 20


@pytest.fixture(scope="module", params=["plain", "mtls"])
def gated(request, chat_model, tmp_path_factory):
    """(whether mTLS is on, the cluster)."""
    from pdserve.cluster import launch

    kv = {}
    if request.param == "mtls":
        folder, ca = tmp_path_factory.mktemp("kv-tls"), trustme.CA()
        leaf = ca.issue_cert("127.0.0.1")
        files = {"cert_file": "cert.pem", "key_file": "key.pem", "ca_file": "ca.pem"}
        files = {k: str(folder / v) for k, v in files.items()}
        leaf.cert_chain_pems[0].write_to_path(files["cert_file"])
        leaf.private_key_pem.write_to_path(files["key_file"])
        ca.cert_pem.write_to_path(files["ca_file"])
        kv["tls"] = files
    config = disagg_config(chat_model, "grpc", True, 1, **kv)
    with launch(config) as cluster:
        yield request.param == "mtls", cluster


@pytest.fixture(scope="module")
def long_streams(chat_model):
    work = [([3 + (5 * i + j) % 250 for j in range(30 + 17 * i)], 240) for i in range(6)]
    return work, greedy_outputs(LLM(chat_model), work)


@pytest.mark.timeout(600)
def test_idle_attacker_streams_hold_nothing(gated, long_streams):
    mtls, cluster = gated
    work, want = long_streams
    decode = cluster.handles("decode-0").worker
    address = ray.get(decode.ready.remote(), timeout=30)["kv_addresses"][0]
    pid = ray.get(decode.ping.remote(), timeout=30)["pid"]
    rss = psutil.Process(pid).memory_info().rss
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    attacker = subprocess.Popen(
        [sys.executable, "-m", "tests.cluster.kv_attacker", "idle", address, "prefill-0", "-"],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert attacker.stdout.readline().strip() == "ready"
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        assert attacker.stdout.readline().strip() == "opened"
        client, streams = cluster.client(), []
        runner = threading.Thread(target=lambda: streams.extend(run_concurrently(client, work)))
        runner.start()
        assert wait_until(lambda: cluster.stats()["in_flight"] >= len(work) // 2, 30)
        got = json.loads(attacker.stdout.readline())  # every attacker stream answered
        runner.join(timeout=300)  # the attacker's streams are still open meanwhile
        assert not runner.is_alive()
        assert attacker.poll() is None  # it held its streams throughout
        out, err = attacker.communicate("stop\n", timeout=60)
    finally:
        attacker.kill()
    assert attacker.returncode == 0, err[-2000:]
    assert json.loads(out.splitlines()[-1]) == {"closed": True}

    for chunks, tokens in zip(streams, want, strict=True):
        assert [t for c in chunks for t in c.token_ids] == tokens
    refusal = ["UNAVAILABLE"] if mtls else ["REJECTED"]
    assert got == {"bare": refusal, "forged": refusal, "replayed": refusal,
                   "answered": False, "answer_bytes": got["answer_bytes"]}  # fmt: skip
    assert got["answer_bytes"] < 100 * 200  # refusals only: no KV byte
    refused = ray.get(
        decode.__ray_call__.remote(lambda w: w.components[0].receiver.refused), timeout=30
    )
    assert refused == (0 if mtls else 100), refused  # under mTLS no handler ran
    grown = psutil.Process(pid).memory_info().rss - rss
    print(f"mtls={mtls}: {refused} refused; the decode process grew {grown / 2**20:.1f} MiB")
    assert grown < RSS_BOUND, f"decode process grew by {grown >> 20} MiB"
    check_pools(cluster)
