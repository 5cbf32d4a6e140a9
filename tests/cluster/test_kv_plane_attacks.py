"""An outsider on the KV plane changes nothing (docs/kv_transfer.md, "Closed by
default"). A live disaggregated cluster (gloo, then grpc) serves long greedy streams
while a separate OS process without the secret (tests/cluster/kv_attacker.py) pushes a
join under the real prefill instance's name, a header announcing 2^40 blocks, 100
bogus joins, or pushes to a live transfer token (read from inside the decode instance,
which an outsider could not do) and 100 bogus ones: every stream equals the offline
output, the live reservation is untouched, every attempt was refused, and the decode
process's memory did not grow."""

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

from engine import LLM, SamplingParams
from engine.messages import Attempt
from kv_transfer import KVDestination
from tests.cluster.helpers import wait_until
from tests.cluster.test_disagg import check_pools, disagg_config, run_concurrently

ROOT = Path(__file__).resolve().parents[2]
RSS_BOUND = 64 << 20  # the decode process may grow this much while it serves the streams


@pytest.fixture(scope="module")
def long_streams(chat_model):
    work = [([3 + (7 * i + j) % 250 for j in range(40 + 13 * i)], 320) for i in range(6)]
    outs = LLM(chat_model).generate(
        [ids for ids, _ in work],
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work],
    )
    return work, [o.token_ids for o in outs]


def _inside(handle, fn):
    """``fn(actor)`` run inside the actor: what an outsider cannot do."""
    return ray.get(handle.__ray_call__.remote(fn), timeout=30)


@pytest.mark.parametrize("backend", ["gloo", "grpc"])
def test_outsider_without_the_secret_changes_nothing(chat_model, long_streams, backend):
    from cluster import launch

    work, want = long_streams
    with launch(disagg_config(chat_model, backend, True, 1)) as cluster:
        decode = cluster.handles("decode-0").worker
        address = ray.get(decode.ready.remote(), timeout=30)["kv_addresses"][0]
        pid = ray.get(decode.ping.remote(), timeout=30)["pid"]
        probe = Attempt("probe#1", tuple(range(3, 40)), SamplingParams(max_tokens=1), "test")
        token = KVDestination.from_bytes(ray.get(decode.reserve.remote(probe), timeout=30)).token
        rss = psutil.Process(pid).memory_info().rss

        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        attacker = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster.kv_attacker", backend, address, "prefill-0",
             token],
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
            assert got == {"pair_formed": False, "bogus_sent": 100}
        else:
            assert got == {"live_token": "REJECTED", "bogus": ["REJECTED"]}
        refused = _inside(decode, lambda w: w.receiver.refused)
        assert refused >= 101, refused
        state = _inside(decode, lambda w: w.receiver.state("probe#1").value)
        assert state == "reserved"  # the live reservation was not touched
        grown = psutil.Process(pid).memory_info().rss - rss
        assert grown < RSS_BOUND, f"decode process grew by {grown >> 20} MiB"
        ray.get(decode.abort.remote(["probe#1"]), timeout=30)
        check_pools(cluster)
