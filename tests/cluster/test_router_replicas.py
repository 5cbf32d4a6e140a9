"""Router replicas (``router.replicas: 2``, router/replicas.py) on real clusters: both
router processes listen on the same gRPC and HTTP ports (SO_REUSEPORT, read from each
process's sockets), clients on connections of their own reach both and get the
offline engine's greedy outputs, co-located and disaggregated; an abort sent to the
replica that does not hold the request ends it; the bounds are split and the stats and
``/metrics`` are the cluster's whichever replica answers (Prometheus' parser); and a
replica killed with SIGKILL leaves the other serving and is restarted on the same
ports, the instances (with ``router.rejoin_grace_s`` 0) dropping its requests and
freeing their blocks at once."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import psutil
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine import LLM, SamplingParams
from tests.cluster.helpers import seconds_until_blocks_free, small_cluster_config, wait_until
from tests.cluster.test_disagg import disagg_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_shared_ray")]

PROMPTS = [[5 + i, 40, 7 * i % 200 + 3, 90, 12] for i in range(6)]
MAX_TOKENS = 12


def launch_replicas(config: dict):
    from pdserve.cluster import launch

    config["router"]["replicas"] = 2
    return launch(config)


def served(cluster) -> list[int]:
    """Requests each replica has placed so far (its own counts)."""
    counts = ray.get([r.own_counts.remote() for r in cluster.routers], timeout=30)
    return [sum(total for _, total in c["instances"].values()) for c in counts]


def client_on_each_replica(cluster) -> dict[int, object]:
    """A ``RouterClient`` (a connection of its own) on each replica: new clients, each
    sending one request, until every replica has placed one of them."""
    found: dict[int, object] = {}
    for _ in range(64):
        before = served(cluster)
        client = cluster.client()
        client.complete(prompt_token_ids=[3, 4, 5], max_tokens=1, temperature=0)
        after = served(cluster)
        (k,) = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
        if k in found:
            client.close()
        else:
            found[k] = client
        if len(found) == len(cluster.routers):
            return found
    raise AssertionError(f"64 connections reached only replicas {sorted(found)}")


def offline(model: str, engine: dict) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in LLM(model, **engine).generate(PROMPTS, params)]


def listeners(pid: int) -> set[int]:
    return {
        c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN"
    }


def greedy_on_each(clients: dict) -> list[list[int]]:
    """PROMPTS spread over the clients in turn; each one's greedy tokens."""
    order = sorted(clients)
    return [
        clients[order[i % len(order)]]
        .complete(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        .token_ids
        for i, p in enumerate(PROMPTS)
    ]


def scrape(cluster) -> dict[tuple, float]:
    """``/metrics`` on a new connection (any replica): (name, sorted labels) -> value."""
    with httpx.Client() as http:  # a client of its own: a connection of its own
        resp = http.get(f"http://{cluster.http_address}/metrics")
    assert resp.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def test_two_replicas_share_the_ports_and_serve_as_one_router(chat_model):
    config = small_cluster_config(chat_model)
    want = offline(chat_model, {"num_kv_blocks": 512, "block_size": 16, "max_batch_tokens": 256})
    with launch_replicas(config) as cluster:
        grpc_port = int(cluster.address.rsplit(":", 1)[1])
        http_port = int(cluster.http_address.rsplit(":", 1)[1])
        for k in range(2):  # each replica's own process listens on both ports
            assert {grpc_port, http_port} <= listeners(cluster.router_pid(replica=k))
        assert cluster.router_pid(replica=0) != cluster.router_pid(replica=1)

        clients = client_on_each_replica(cluster)
        assert greedy_on_each(clients) == want

        # the bounds are split, the stats summed whichever replica is asked
        counts = ray.get([r.own_counts.remote() for r in cluster.routers], timeout=30)
        assert [c["max_queue"] for c in counts] == [8, 8]
        stats = cluster.stats()
        assert (stats["max_queue"], stats["replicas"]) == (16, 2)
        assert sum(i["requests_total"] for i in stats["instances"]) == sum(served(cluster))

        # an abort by id reaches the replica holding the request, from either one
        for holder, asker in ((0, 1), (1, 0)):
            stream = clients[holder].generate(prompt_token_ids=PROMPTS[0], max_tokens=900,
                                              temperature=0, ignore_eos=True)  # fmt: skip
            first = next(stream)
            assert clients[asker].abort(first.request_id)
            assert [c.finish_reason for c in stream][-1] == "abort"
        seconds_until_blocks_free(cluster)

        # /metrics: the request counters summed over both replicas, whoever answers
        length = ("pdserve:request_success_total", (("finished_reason", "length"),
                                                    ("model_name", chat_model)))  # fmt: skip
        finished = sum(served(cluster)) - 2  # all but the two aborted ran to their length
        for _ in range(6):
            assert scrape(cluster)[length] == finished
        for client in clients.values():
            client.close()


def test_disaggregated_replicas_serve_the_offline_greedy(chat_model):
    config = disagg_config(chat_model, "grpc", True, 1)
    want = offline(chat_model, {"num_kv_blocks": 256, "block_size": 16, "max_batch_tokens": 128})
    with launch_replicas(config) as cluster:
        clients = client_on_each_replica(cluster)
        assert greedy_on_each(clients) == want
        seconds_until_blocks_free(cluster)
        for client in clients.values():
            client.close()


def test_a_killed_replica_is_restarted_and_without_grace_its_requests_dropped(chat_model):
    config = small_cluster_config(chat_model, rejoin_grace_s=0)
    with launch_replicas(config) as cluster:
        clients = client_on_each_replica(cluster)
        stream = clients[1].generate(prompt_token_ids=PROMPTS[1], max_tokens=900,
                                     temperature=0, ignore_eos=True)  # fmt: skip
        next(stream)
        ended = threading.Event()

        def read():
            try:
                for _ in stream:
                    pass
            except Exception:  # the router went away under it
                pass
            ended.set()

        threading.Thread(target=read, daemon=True).start()
        tokens = sum(i["tokens_total"] for i in cluster.stats()["instances"])
        killed = cluster.router_pid(replica=1)
        os.kill(killed, signal.SIGKILL)
        assert ended.wait(30)
        # the instances drop the dead replica's request (its feeds ended) and free its
        # blocks, within a few steps: it does not run on to its 900 tokens
        seconds_until_blocks_free(cluster, within_s=30)
        assert sum(i["tokens_total"] for i in cluster.stats()["instances"]) - tokens < 600
        # new connections are served, by the survivor or the restarted replica
        for _ in range(6):
            with cluster.client() as client:
                got = client.complete(prompt_token_ids=PROMPTS[2], max_tokens=4, temperature=0)
                assert got.finish_reason == "length"
        # the killed replica is back, a new process on the same ports
        ports = {int(a.rsplit(":", 1)[1]) for a in (cluster.address, cluster.http_address)}

        def restarted() -> bool:
            try:
                pid = cluster.router_pid(timeout_s=1.0, replica=1)
            except ray.exceptions.RayError:  # still restarting
                return False
            return pid != killed and ports <= listeners(pid)

        assert wait_until(restarted, 30, interval_s=0.2)
        assert wait_until(lambda: cluster.stats()["replicas"] == 2, 30)
        assert cluster.drain(timeout_s=5) == 0
        clients[0].close()
