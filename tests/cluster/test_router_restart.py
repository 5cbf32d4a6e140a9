"""The router can die and come back without losing a request (docs/serving.md, "Router
restarts and resuming"): a real disaggregated cluster (1 prefill + 1 decode, gloo, the
tiny model), 8 greedy streams in flight (5 gRPC ones through ``RouterClient``, 3
streamed HTTP completions that resume through ``GET /v1/requests/{id}/stream``), and
the router actor's process stopped by a real signal. Ray restarts a killed router, the launcher's
keeper kills a hung one (SIGSTOP) and starts each new incarnation on the same ports; the
new one rebuilds its streams from what the instances kept for it and the clients
resume them: every stream ends with the offline greedy tokens, the instances keep
their processes, and every block is free after; requests sent while no router listens
wait for the next one. A router restarted after an instance's
restart routes to the new incarnation; a rebuilt request no client resumes is dropped
after ``router.resume_retention_s``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import grpc
import httpx
import pytest
import ray

from pdserve.engine import LLM, SamplingParams
from pdserve.router import pdserve_pb2 as pb
from pdserve.router import pdserve_pb2_grpc as pb_grpc
from pdserve.router.client import RouterClient
from pdserve.router.client_types import make_request
from tests.cluster.helpers import seconds_until_blocks_free, wait_until
from tests.cluster.test_disagg import disagg_config, greedy_outputs

pytestmark = pytest.mark.timeout(420)

# long enough that every stream is still running when the router is stopped
WORK = [([5 + k, 40, 41, 42 + k, 7] * (k + 1), 600 + 20 * k) for k in range(8)]
HTTP = {1, 4, 6}  # the streams that go over HTTP; the others over gRPC


def restart_config(model: str) -> dict:
    config = disagg_config(model, "gloo", True, 1)
    for pool in ("prefill", "decode"):
        config[pool]["kv_blocks"] = 1024  # 8 streams of up to 780 tokens
    config["router"].update(
        heartbeat_s=0.5, unresponsive_s=4.0, rejoin_grace_s=60.0, resume_retention_s=120.0
    )
    return config


@pytest.fixture(scope="module")
def want(chat_model):
    """The offline greedy tokens of each request of ``WORK``, and their text."""
    llm = LLM(chat_model)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in WORK]
    texts = [o.text for o in llm.generate([ids for ids, _ in WORK], params)]
    return greedy_outputs(llm, WORK), texts


class Streams:
    """The 8 requests of ``WORK``, each read to its end by a thread of its own through
    one ``RouterClient`` (which resumes a broken stream by itself)."""

    def __init__(self, address: str, http_address: str):
        self.client = RouterClient(address, resume_s=120.0)
        self.http = f"http://{http_address}"
        self.tokens: list[list[int]] = [[] for _ in WORK]
        self.texts = [""] * len(WORK)
        self.counts = [0] * len(WORK)  # tokens received: gRPC's, or HTTP's last event id
        self.ends: list[str | None] = [None] * len(WORK)
        self.resumed = [0] * len(WORK)
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._read, args=(k,), daemon=True) for k in range(len(WORK))
        ]
        for t in self.threads:
            t.start()

    def _read(self, k: int) -> None:
        ids, max_tokens = WORK[k]
        try:
            if k in HTTP:
                self._read_http(k)
                return
            stream = self.client.generate(
                prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
            )
            for chunk in stream:
                self.tokens[k] += chunk.token_ids
                self.counts[k] = len(self.tokens[k])
                self.ends[k] = chunk.finish_reason
            self.resumed[k] = stream.resumed
        except BaseException as e:  # the test reports it
            self.errors.append(e)

    def _read_http(self, k: int) -> None:
        """A streamed completion with an id of its own; when its connection breaks before
        ``[DONE]``, resumed after the last event id received (the tokens it has), with
        backoff, while the router answers 503 or not at all."""
        ids, max_tokens = WORK[k]
        request_id = f"http-{k}-{time.monotonic_ns()}"
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        call = ("POST", "/v1/completions", body)
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=self.http, timeout=httpx.Timeout(30, read=60)) as http:
            while time.monotonic() < deadline:
                method, path, payload = call
                try:
                    headers = {"X-Request-Id": request_id}
                    with http.stream(method, path, json=payload, headers=headers) as resp:
                        if resp.status_code == 503:  # rebuilding its view: retry
                            time.sleep(0.2)
                            continue
                        assert resp.status_code == 200, resp.read()
                        assert resp.headers["X-Request-Id"] == request_id
                        if self._events(k, resp):
                            return
                except httpx.TransportError:  # the router died under it, or is not back
                    time.sleep(0.2)
                self.resumed[k] += 1
                call = ("GET", f"/v1/requests/{request_id}/stream?after={self.counts[k]}", None)
        raise AssertionError(f"HTTP stream {k} did not end within 120 s")

    def _events(self, k: int, resp) -> bool:
        """Read server-sent events into the stream's text; True at ``[DONE]``."""
        event: dict[str, str] = {}
        for line in resp.iter_lines():
            if line:
                key, _, value = line.partition(": ")
                event[key] = value
                continue
            if event.get("data") == "[DONE]":
                return True
            chunk = json.loads(event["data"])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            self.texts[k] += choice["text"]  # a whole event: its text and its id together
            self.counts[k] = int(event["id"])
            self.ends[k] = choice["finish_reason"]
            event = {}
        return False

    def all_started(self) -> bool:
        return all(n >= 2 for n in self.counts)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), self.counts
        self.client.close()


def instance_pids(cluster) -> dict[str, int]:
    return {n: ray.get(h.ping.remote(), timeout=30)["pid"] for n, h in cluster.workers.items()}


PROBES: list[float] = []  # probe requests that may have reached the instances


def serves_new_requests(address: str) -> bool:
    """A new request completes through the router at ``address`` (within 5 s); a plain
    stub, failing at once while no router listens (``RouterClient`` would wait for one)."""
    try:
        with grpc.insecure_channel(address) as channel:
            request = make_request(prompt_token_ids=[9, 8, 7], max_tokens=2)
            got = list(pb_grpc.RouterStub(channel).Generate(request, timeout=5))
            PROBES.append(time.monotonic())
            return got[-1].finish_reason == "length"
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:  # UNAVAILABLE: refused before placing
            PROBES.append(time.monotonic())
        return False


def router_pid_now(cluster) -> int | None:
    with contextlib.suppress(ray.exceptions.RayError):
        return cluster.router_pid(timeout_s=1.0)
    return None


def prefilled(cluster) -> int:
    """Requests the prefill instance has taken so far (every placement is one)."""
    return ray.get(cluster.workers["prefill-0"].stats.remote(), timeout=30)["requests_total"]


def check_kept(cluster, probes_before: int, late: int = 0) -> None:
    """The instances kept the 8 requests running for the new router: none was placed
    again (the prefill instance took no request besides the probes and ``late`` ones)."""
    placed = 8 + late + len(PROBES) - probes_before
    assert prefilled(cluster) <= placed, (prefilled(cluster), PROBES)


def check_streams(streams: Streams, want) -> None:
    tokens, texts = want
    assert not streams.errors, streams.errors
    for k in range(len(WORK)):
        assert streams.ends[k] == "length", (k, streams.ends[k], streams.counts[k])
        assert streams.counts[k] == len(tokens[k]), (k, streams.counts[k])
        if k in HTTP:
            assert streams.texts[k] == texts[k], k
        else:
            assert streams.tokens[k] == tokens[k], k
    # the router died under every stream: each had to resume at least once
    assert all(n >= 1 for n in streams.resumed), streams.resumed


class LateStreams:
    """``RouterClient`` streams of some of ``WORK``'s requests, each started on a thread
    at once: sent while the router is down, they wait for it (probing, then sending the
    request again: router/client_streams.py)."""

    def __init__(self, address: str, which: list[int]):
        self.tokens: dict[int, list[int]] = {}
        self.errors: dict[int, BaseException] = {}
        self.threads = [threading.Thread(target=self._run, args=(address, k)) for k in which]
        for t in self.threads:
            t.start()

    def _run(self, address: str, k: int) -> None:
        ids, max_tokens = WORK[k]
        try:
            with RouterClient(address) as client:
                stream = client.generate(
                    prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0,
                    ignore_eos=True, timeout=120,
                )  # fmt: skip
                self.tokens[k] = [t for chunk in stream for t in chunk.token_ids]
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors[k] = e

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout_s)


def test_a_killed_router_comes_back_and_every_stream_resumes(chat_model, want, on_shared_ray):
    from pdserve.cluster import launch

    with launch(restart_config(chat_model)) as cluster:
        pids = instance_pids(cluster)
        old = cluster.router_pid()
        streams = Streams(cluster.address, cluster.http_address)
        assert wait_until(streams.all_started, 60), streams.counts
        assert not any(streams.ends), streams.ends  # all 8 in flight
        probes = len(PROBES)
        killed = time.monotonic()
        os.kill(old, signal.SIGKILL)  # a real signal to the router actor's process
        late = LateStreams(cluster.address, [0, 2])  # sent while no router listens
        # Ray starts the router's new incarnation in a worker process of its own: a few
        # seconds on an idle host, longer on a loaded one (a full suite's run took past
        # 10 s), so the bound is generous and the figure printed
        assert wait_until(lambda: serves_new_requests(cluster.address), 60, interval_s=0.2)
        print(f"the router served again {time.monotonic() - killed:.1f} s after the kill")
        assert router_pid_now(cluster) not in (None, old)
        streams.join(240)
        check_streams(streams, want)
        late.join(240)
        assert late.tokens == {k: want[0][k] for k in (0, 2)}, late.errors
        check_kept(cluster, probes, late=2)
        assert instance_pids(cluster) == pids  # the instances never stopped
        seconds_until_blocks_free(cluster, within_s=30)


def test_a_hung_router_is_replaced_and_every_stream_resumes(chat_model, want, on_shared_ray):
    from pdserve.cluster import launch

    with launch(restart_config(chat_model)) as cluster:
        pids = instance_pids(cluster)
        old = cluster.router_pid()
        streams = Streams(cluster.address, cluster.http_address)
        assert wait_until(streams.all_started, 60), streams.counts
        assert not any(streams.ends), streams.ends
        probes = len(PROBES)
        stopped = time.monotonic()
        os.kill(old, signal.SIGSTOP)  # hung: its sockets stay open, it answers nothing
        try:
            # the keeper (router.unresponsive_s=4) kills it: its SIGKILL ends the stopped
            # process (no SIGCONT needed); then Ray starts a new incarnation, a worker
            # process of its own (slower on a loaded host: a generous bound)
            killed = wait_until(lambda: not _alive(old), 15, interval_s=0.2)
            assert killed, f"the hung router (pid {old}) was not killed within 15 s"
            assert time.monotonic() - stopped <= 15.0
            replaced = wait_until(
                lambda: router_pid_now(cluster) not in (None, old), 60, interval_s=0.2
            )
            assert replaced, "Ray did not start a new router within 60 s of the kill"
            assert wait_until(lambda: serves_new_requests(cluster.address), 10, interval_s=0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGCONT)
        streams.join(240)
        check_streams(streams, want)
        check_kept(cluster, probes)
        assert instance_pids(cluster) == pids
        seconds_until_blocks_free(cluster, within_s=30)


def _alive(pid: int) -> bool:
    """The process runs (a zombie left for its parent to reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_router_restarted_after_an_instance_restart_finds_its_new_incarnation(
    chat_model, on_shared_ray
):
    """The new router takes the instances from the supervisor (their current handles and
    generations), not from the launch: a decode instance restarted before the router
    dies is the one it routes to."""
    from pdserve.cluster import launch

    with launch(restart_config(chat_model)) as cluster:
        old_decode = instance_pids(cluster)["decode-0"]
        os.kill(old_decode, signal.SIGKILL)

        def decode_back() -> bool:
            (decode,) = [i for i in cluster.stats()["instances"] if i["name"] == "decode-0"]
            return decode["state"] == "serving" and decode["restarts"] == 1

        assert wait_until(decode_back, 120, interval_s=0.5)
        assert serves_new_requests(cluster.address)
        os.kill(cluster.router_pid(), signal.SIGKILL)
        assert wait_until(lambda: serves_new_requests(cluster.address), 15, interval_s=0.2)
        (decode,) = [i for i in cluster.stats()["instances"] if i["name"] == "decode-0"]
        assert decode["restarts"] == 1 and decode["state"] == "serving", decode
        assert instance_pids(cluster)["decode-0"] != old_decode
        seconds_until_blocks_free(cluster, within_s=30)


def test_a_rebuilt_request_no_client_resumes_is_dropped_after_the_retention(
    chat_model, on_shared_ray
):
    """Its client gone with the router, a rebuilt request is kept only
    ``router.resume_retention_s``: then a resume finds nothing and every block is free."""
    from pdserve.cluster import launch

    config = restart_config(chat_model)
    config["router"]["resume_retention_s"] = 3.0
    with launch(config) as cluster:
        ids, max_tokens = WORK[7]
        with RouterClient(cluster.address, resume_s=0) as client:  # never resumes
            stream = client.generate(prompt_token_ids=ids, max_tokens=max_tokens,
                                     temperature=0, ignore_eos=True)  # fmt: skip
            got = len(next(stream).token_ids)
            os.kill(cluster.router_pid(), signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as broken:
                got += sum(len(c.token_ids) for c in stream)
            assert broken.value.code() == grpc.StatusCode.UNAVAILABLE
            request_id = stream.request_id
        assert got < max_tokens
        # the bound here is on the restart under the suite's load, not what this test checks
        assert wait_until(lambda: serves_new_requests(cluster.address), 30, interval_s=0.2)
        time.sleep(3.0 + 1.0)  # past the retention
        with grpc.insecure_channel(cluster.address) as channel:
            resume = pb_grpc.RouterStub(channel).Resume
            late = resume(pb.ResumeRequest(request_id=request_id, after=got), timeout=10)
            with pytest.raises(grpc.RpcError) as gone:
                next(iter(late))
            assert gone.value.code() == grpc.StatusCode.INVALID_ARGUMENT, gone.value
            assert "no request of this key to resume" in gone.value.details()
        seconds_until_blocks_free(cluster, within_s=30)
