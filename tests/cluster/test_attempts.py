"""Attempts are handled once, and every stream is bounded by progress, through a real
cluster of the configs/local-disagg.yaml shape (one prefill, one decode instance; Ray
actors, the gRPC router, the real engine on a tiny model) with real signals to real
processes.

The decode instance is SIGSTOPped, a request is sent (its reservation goes up the
instance's feed and waits there unanswered), and the stopped process is SIGKILLed: the
router hears of the attempt's end twice (the instance's death, then the reservation's
failure) and must migrate the request once. Three times in a row on the same
instance: each restart is readmitted (health SERVING), each request ends with the
offline greedy output after exactly two attempts, no hold stays at the router and every
KV block is free.

With a small ``router.stall_timeout_s`` (and a supervisor too slow to notice), a
SIGSTOPped instance's stream ends with an error naming what it waited for: the
reservation, the prefill and its KV, the next token.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import ray

from pdserve.engine import SamplingParams
from tests.cluster.helpers import wait_until
from tests.cluster.test_disagg import check_pools, disagg_config
from tests.cluster.test_launch import health

PROMPT = list(range(3, 83))  # 80 tokens: 5 blocks
MAX_TOKENS = 6
RESTART_BOUND_S = 90  # kill -> restarted, model loaded and serving again


def pid_of(cluster, name: str) -> int:
    """The process id of rank 0 of ``name``'s current incarnation."""
    return ray.get(cluster.handles(name).worker.ready.remote(), timeout=30)["pid"]


def instance(cluster, name: str) -> dict:
    (mine,) = [i for i in cluster.stats()["instances"] if i["name"] == name]
    return mine


class Request(threading.Thread):
    """One request read to its end on a thread of its own: ``done`` or ``error``."""

    def __init__(self, client, request_id: str, max_tokens: int = MAX_TOKENS):
        super().__init__(daemon=True)
        self.client, self.request_id, self.max_tokens = client, request_id, max_tokens
        self.tokens: list[int] = []
        self.done = self.error = None
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            for chunk in self.client.generate(
                prompt_token_ids=PROMPT, max_tokens=self.max_tokens, temperature=0,
                ignore_eos=True, request_id=self.request_id,
            ):  # fmt: skip
                self.tokens += chunk.token_ids
                if chunk.finish_reason is not None:
                    self.done = chunk
        except grpc.RpcError as e:
            self.error = e
        self.ended_at = time.monotonic()


@pytest.mark.timeout(600)
def test_decode_killed_while_its_reservation_is_pending_three_times(chat_model):
    from pdserve.cluster import launch
    from pdserve.engine import LLM

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = LLM(chat_model).generate([PROMPT], params)[0].token_ids
    config = disagg_config(chat_model, "gloo", True, 1)
    # the test's SIGKILL, not the supervisor's ping, ends the stopped instance
    config["supervisor"] = {"heartbeat_s": 0.5, "unresponsive_s": 60.0}
    with launch(config) as cluster, cluster.client() as client:
        for n in (1, 2, 3):
            victim = pid_of(cluster, "decode-0")
            os.kill(victim, signal.SIGSTOP)
            request = Request(client, f"pending-{n}")
            try:  # placed: decode-0 holds it, its reservation sent and unanswered
                assert wait_until(lambda: instance(cluster, "decode-0")["outstanding"], 30)
                time.sleep(0.2)
            finally:
                os.kill(victim, signal.SIGKILL)
            request.join(RESTART_BOUND_S + 30)
            assert request.error is None, request.error
            assert request.done is not None and request.tokens == want, request.tokens
            timings = request.done.timings
            assert timings.attempts == 2, timings  # one failure, one migration
            # the first attempt never got past its reservation: no instance served it
            assert timings.instances == ["prefill-0", "decode-0"], timings.instances
            back = instance(cluster, "decode-0")
            assert back["state"] == "serving" and back["restarts"] == n, back
            assert health(cluster.address) == "SERVING"
            stats = cluster.stats()
            assert stats["in_flight"] == 0, stats
            assert all(i["outstanding"] == 0 for i in stats["instances"]), stats
            check_pools(cluster)
        # the third incarnation serves like the first
        again = client.complete(prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                ignore_eos=True)  # fmt: skip
        assert again.token_ids == want and again.timings.attempts == 1


STALL_S = 2.0
STALL_BOUND_S = STALL_S + 15  # the signal -> the client's error, generously


@pytest.mark.timeout(300)
def test_a_stalled_stream_ends_naming_what_it_waited_for(chat_model):
    from pdserve.cluster import launch

    config = disagg_config(chat_model, "gloo", True, 1)
    config["router"]["stall_timeout_s"] = STALL_S
    # slower than the stall bound: the stopped instance is not failed meanwhile
    config["supervisor"] = {"heartbeat_s": 0.5, "unresponsive_s": 120.0}
    cases = [  # the instance stopped, before the request or once it streams, the words
        ("decode-0", False, "decode-0 to reserve blocks for the KV"),
        ("prefill-0", False, "prefill-0 to compute the prompt and send its KV to decode-0"),
        ("decode-0", True, "tokens from decode-0"),
    ]
    with launch(config) as cluster, cluster.client() as client:
        for n, (name, streaming, words) in enumerate(cases):
            pid = pid_of(cluster, name)
            if not streaming:
                os.kill(pid, signal.SIGSTOP)
            request = Request(client, f"stall-{n}", max_tokens=900)
            try:
                if streaming:
                    assert wait_until(lambda r=request: len(r.tokens) >= 4, 60), request.tokens
                    os.kill(pid, signal.SIGSTOP)
                stopped = time.monotonic()
                request.join(STALL_BOUND_S + 5)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert request.error is not None, (request.done, len(request.tokens))
            assert request.error.code() == grpc.StatusCode.INTERNAL
            details = request.error.details()
            assert f"router.stall_timeout_s={STALL_S:g}" in details, details
            assert f"waited for {words}" in details, details
            assert STALL_S <= request.ended_at - stopped < STALL_BOUND_S, details
            check_pools(cluster)
            assert all(i["outstanding"] == 0 for i in cluster.stats()["instances"])
        # the resumed instances serve again
        done = client.complete(prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS)
        assert len(done.token_ids) == MAX_TOKENS
