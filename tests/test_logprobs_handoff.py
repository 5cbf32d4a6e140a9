"""Logprobs and penalties through the instances' own entry points, in this process: a
prefill instance samples the first token (penalties over prompt + delivered), its
logprobs travel in the ``Handoff`` over a real KV transfer (grpc), and the decode
instance's updates carry every token's; a co-located instance's updates too. Fresh and
resumed (``delivered``, as after a migration), the tokens and logprobs are the offline
engine's."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.instance.messages import Attempt
from pdserve.instance.worker import EngineWorker
from tests.kv_transfer.helpers import WORKER_KV
from tests.roles import worker

CONFIG = {"num_kv_blocks": 64, "max_batch_tokens": 32}
PROMPT = (7, 7, 8, 9, 7, 30, 31, 32, 33, 7, 8)
PARAMS = {
    "greedy": SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.4,
                             frequency_penalty=0.8, logprobs=4, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=12, temperature=0.8, top_k=-1, seed=3,
                             presence_penalty=1.0, logprobs=0, ignore_eos=True),
}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(tiny_model("gqa2"), **{"num_kv_blocks": 64, "max_batch_tokens": 32})
    return {mode: llm.generate(list(PROMPT), p)[0] for mode, p in PARAMS.items()}


@pytest.fixture(scope="module")
def workers(tiny_model):
    """The three instances, one torch thread each (a worker sets the process's count:
    restored after the module)."""
    threads, path = torch.get_num_threads(), tiny_model("gqa2")
    made = {
        "colocated": EngineWorker("colocated-0", path, CONFIG, 1),
        "prefill": worker("prefill", "prefill-0", path, CONFIG, 1, WORKER_KV),
        "decode": worker("decode", "decode-0", path, CONFIG, 1, WORKER_KV),
    }
    yield made
    for w in made.values():
        w.stop()
    torch.set_num_threads(threads)


def collect(worker, attempt_id: str, until=lambda u: u.final, timeout_s: float = 60):
    """The updates of ``attempt_id`` on ``worker``'s ``test`` outbox until ``until``."""
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        updates = worker.poll("test", 1.0).updates
        for u in updates:
            assert u.request_id == attempt_id and u.error is None, u.error
            got.append(u)
            if until(u):
                return got
    raise AssertionError(f"{attempt_id}: no final update within {timeout_s} s")


def assert_continues(full, k: int, updates) -> None:
    """The updates carry exactly the tokens after the first ``k`` of ``full``, each with
    its logprobs (prefill + delivered computes the logits in another batch shape than
    decoding did: equal to float32 rounding when k > 0, bit for bit when k = 0)."""
    tokens = [t for u in updates for t in u.token_ids]
    logprobs = [lp for u in updates for lp in u.logprobs]
    assert tokens == full.token_ids[k:]
    assert [lp.token_id for lp in logprobs] == tokens
    want = full.logprobs[k:]
    assert [lp.top_ids for lp in logprobs] == [lp.top_ids for lp in want]
    if k == 0:
        assert logprobs == want
    for got, ref in zip(logprobs, want, strict=True):
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-5)
        assert got.top_logprobs == pytest.approx(ref.top_logprobs, abs=1e-5)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_colocated_instance_sends_logprobs(workers, reference, mode):
    w, full = workers["colocated"], reference[mode]
    for k in (0, 5):
        a = Attempt(f"c-{mode}-{k}", PROMPT, PARAMS[mode], "test",
                    delivered=tuple(full.token_ids[:k]))  # fmt: skip
        w.add(a)
        assert_continues(full, k, collect(w, a.id))


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_first_token_logprobs_travel_in_the_handoff(workers, reference, mode):
    p, d, full = workers["prefill"], workers["decode"], reference[mode]
    for k in (0, 5):
        a = Attempt(f"d-{mode}-{k}#0", PROMPT, PARAMS[mode], "test", decode=d.name,
                    delivered=tuple(full.token_ids[:k]))  # fmt: skip
        destination = d.reserve(a)
        assert destination is not None
        p.prefill(replace(a, destination=destination))
        updates = collect(d, a.id)
        assert updates[0].token_ids[0] == full.token_ids[k]  # sampled on the prefill side
        assert_continues(full, k, updates)
        collect(p, a.id, until=lambda u: u.handed_off)
    assert p.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]
    assert d.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]
