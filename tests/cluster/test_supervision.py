"""An instance killed under its streams (a real SIGKILL to its real process; a decode
instance also SIGSTOPped): every stream continues on another instance and ends exactly
as an uninterrupted run (greedy and seeded sampling, with penalties and logprobs; the
co-located pool speculating, so its guesses survive migration too), the
supervisor restarts the
instance and the router takes it back, and no KV block stays held. Each test on a
cluster of its own."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from pdserve.engine import SamplingParams
from tests.cluster.helpers import seconds_until_blocks_free, small_cluster_config, wait_until
from tests.cluster.test_disagg import disagg_config

PROMPTS = [list(range(5 + i, 45 + i)) for i in range(4)]
SAMPLING = [  # two greedy streams, two seeded ones; one of each with penalties and logprobs
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3, logprobs=2),
    dict(temperature=0.8, top_p=0.9, seed=7),
    dict(temperature=0.8, top_p=0.9, seed=11, presence_penalty=0.5, logprobs=0),
]
MAX_TOKENS = 400
SUPERVISOR = {"heartbeat_s": 0.5, "unresponsive_s": 3.0}
RESTART_BOUND_S = 90  # kill -> restarted, model loaded and serving again


def expected(model: str) -> list:
    """The uninterrupted runs' outputs (tokens, and logprobs where asked)."""
    from pdserve.engine import LLM

    llm = LLM(model)
    return [
        llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **s))[0]
        for p, s in zip(PROMPTS, SAMPLING, strict=True)
    ]


def assert_same_logprobs(got: list, want: list) -> None:
    """A migrated stream's logprobs: one per token, the same alternatives, the values to
    float32 rounding (its next attempt prefilled prompt + delivered tokens at once)."""
    assert [x.top_ids for x in got] == [x.top_ids for x in want]
    values = [(x.logprob, *x.top_logprobs) for x in got]
    assert values == [pytest.approx((x.logprob, *x.top_logprobs), abs=1e-5) for x in want]


class Streams:
    """The four requests streaming at once, each read on a thread of its own."""

    def __init__(self, client):
        self.tokens = [[] for _ in PROMPTS]
        self.logprobs = [[] for _ in PROMPTS]
        self.ends: list = [None] * len(PROMPTS)
        self.threads = [
            threading.Thread(target=self._read, args=(client, i), daemon=True)
            for i in range(len(PROMPTS))
        ]
        for t in self.threads:
            t.start()

    def _read(self, client, i: int) -> None:
        try:
            kw = dict(max_tokens=MAX_TOKENS, ignore_eos=True, request_id=f"s{i}", **SAMPLING[i])
            for chunk in client.generate(prompt_token_ids=PROMPTS[i], **kw):
                self.tokens[i] += chunk.token_ids
                self.logprobs[i] += chunk.logprobs or []
                if chunk.finish_reason is not None:
                    self.ends[i] = chunk
        except Exception as e:  # reported by the test
            self.ends[i] = e

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads), self.tokens


def busiest(cluster, role: str, rank: int = 0) -> tuple[str, int]:
    """The instance of ``role`` holding the most streams, and the pid of its tensor-parallel
    rank ``rank``'s process."""
    instances = [i for i in cluster.stats()["instances"] if i["role"] == role]
    victim = max(instances, key=lambda i: i["outstanding"])["name"]
    handles = cluster.handles(victim)
    actor = handles.worker if rank == 0 else handles.ranks[rank - 1]
    return victim, ray.get(actor.ready.remote())["pid"]


def back_in_service(cluster, victim: str) -> dict:
    def serving():
        try:
            instances = cluster.stats()["instances"]
        except ray.exceptions.RayError:  # the router restarting (its keeper replaced it)
            return None
        mine = [i for i in instances if i["name"] == victim]
        return mine[0] if mine[0]["state"] == "serving" and mine[0]["restarts"] >= 1 else None

    started = time.monotonic()
    back = wait_until(serving, RESTART_BOUND_S, interval_s=0.25)
    assert back, cluster.stats()
    print(f"{victim}: back in service {time.monotonic() - started:.1f} s after the streams ended")
    return back


def survive(cluster, role: str, sig=signal.SIGKILL, rank: int = 0) -> str:
    """Start the streams, signal an instance of ``role`` once each has 8 tokens, and
    check every stream against the uninterrupted run."""
    want = expected(cluster.config.model)
    with cluster.client() as client:
        streams = Streams(client)
        assert wait_until(lambda: min(map(len, streams.tokens)) >= 1, 60), streams.tokens
        victim, pid = busiest(cluster, role, rank)  # every stream placed
        # the signal follows the 8th token at once: the look-up above takes a loaded host
        # long enough for a tiny model to finish the streams
        assert wait_until(lambda: min(map(len, streams.tokens)) >= 8, 60), streams.tokens
        os.kill(pid, sig)
        killed_at = time.monotonic()
        streams.join(120)
        print(f"streams ended {time.monotonic() - killed_at:.1f} s after the signal")
        for i, end in enumerate(streams.ends):
            assert not isinstance(end, Exception), (i, end)
            assert streams.tokens[i] == want[i].token_ids, (i, SAMPLING[i], end.timings)
            assert_same_logprobs(streams.logprobs[i], want[i].logprobs or [])
        migrated = [e for e in streams.ends if e.timings.attempts > 1]
        assert migrated, [e.timings for e in streams.ends]
        assert all(victim in e.timings.instances for e in migrated)
    return victim


def test_colocated_streams_survive_their_instance(chat_model):
    from pdserve.cluster import launch

    config = small_cluster_config(chat_model, policy="round_robin")
    config["colocated"]["speculative"] = {"method": "ngram", "num_tokens": 3}
    config["supervisor"] = SUPERVISOR
    with launch(config) as cluster:
        victim = survive(cluster, "colocated")
        back_in_service(cluster, victim)
        seconds_until_blocks_free(cluster)
        # both instances serve again, guessing: one request at a time (an instance stops
        # guessing with 4 running, as the survivor ran after the migration), each prompt
        # a repeated span the guesser draws from
        with cluster.client() as client:
            done = [client.complete(prompt_token_ids=[7, 8, 9, 10] * 6, max_tokens=16,
                                    temperature=0, ignore_eos=True) for _ in range(4)]  # fmt: skip
        served = {d.timings.instances[0] for d in done}
        assert victim in served, served
        assert all(d.timings.guessed_tokens > 0 for d in done), [d.timings for d in done]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_disaggregated_streams_survive_their_decode_instance(chat_model, sig):
    from pdserve.cluster import launch

    config = disagg_config(chat_model, "gloo", True, 1)
    config["decode"].update(instances=2, resources={"num_cpus": 0.5})
    config["supervisor"] = SUPERVISOR
    with launch(config) as cluster:
        victim = survive(cluster, "decode", sig)
        back_in_service(cluster, victim)
        seconds_until_blocks_free(cluster)


def test_a_lost_tensor_parallel_rank_fails_its_whole_instance(chat_model):
    from pdserve.cluster import launch

    config = disagg_config(chat_model, "gloo", True, 1)
    config["ray"] = {"num_cpus": 4}
    bundle = {"tensor_parallel": 2, "resources": {"num_cpus": 0.5}}
    config["decode"].update(instances=2, **bundle)
    config["supervisor"] = SUPERVISOR
    with launch(config) as cluster:
        victim = survive(cluster, "decode", rank=1)
        back_in_service(cluster, victim)
        seconds_until_blocks_free(cluster)


def test_requests_wait_for_the_only_decode_instance_to_come_back(chat_model):
    """With no other decode instance, health says NOT_SERVING while it restarts, and
    its streams continue on it once the router takes it back."""
    from pdserve.cluster import launch
    from tests.cluster.test_launch import health

    config = disagg_config(chat_model, "grpc", False, 1)
    config["supervisor"] = SUPERVISOR
    with launch(config) as cluster:
        seen = []
        watching = threading.Event()

        def watch():
            while not watching.is_set():
                seen.append(health(cluster.address))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        survive(cluster, "decode")
        watching.set()
        watcher.join(10)
        assert "NOT_SERVING" in seen and seen[-1] == "SERVING", seen
        back_in_service(cluster, "decode-0")
        seconds_until_blocks_free(cluster)
