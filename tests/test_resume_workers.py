"""Resuming through the instances' own entry points: an ``Attempt`` with ``delivered`` /
``delivered_chars`` on a co-located instance (``EngineWorker.add``), and on a prefill and
a decode instance handing the request over through a real KV transfer (grpc, checksums
on), all in this process. The continuation is the uninterrupted run's rest."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.instance.messages import Attempt
from pdserve.instance.worker import EngineWorker
from tests.kv_transfer.helpers import WORKER_KV
from tests.resume_utils import (
    PROMPTS,
    Stream,
    assert_resumes,
    cut_points,
    sampling,
    stop_string_of,
    stream_of,
)
from tests.roles import worker

CONFIG = {"num_kv_blocks": 128, "max_batch_tokens": 32}
THREADS = 2  # as tests/conftest.py: the reference runs' numerics


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted streams (greedy and seeded, each with a stop string) and where
    to cut them, from a plain engine."""
    engine = LLMEngine("smollm2-135m", EngineConfig(**CONFIG))
    prompt, tok = PROMPTS["ja"], engine.tokenizer
    out = {}
    for mode in ("greedy", "seeded"):
        params = sampling(mode, [stop_string_of(stream_of(engine, mode, prompt, sampling(mode)))])
        full = stream_of(engine, mode, prompt, params)
        cuts = cut_points(full, len(tok.encode(prompt)), engine.blocks.block_size, tok)
        out[mode] = (params, full, cuts)
    return out


@pytest.fixture(scope="module")
def workers():
    made = {
        "colocated": EngineWorker("colocated-0", "smollm2-135m", CONFIG, THREADS),
        "prefill": worker("prefill", "prefill-0", "smollm2-135m", CONFIG, THREADS, WORKER_KV),
        "decode": worker("decode", "decode-0", "smollm2-135m", CONFIG, THREADS, WORKER_KV),
    }
    yield made
    for w in made.values():
        w.stop()


def collect(worker, attempt_id: str, until=lambda u: u.final, timeout_s: float = 120) -> Stream:
    """The updates of ``attempt_id`` on ``worker``'s ``test`` outbox as a stream, until
    one satisfies ``until``; an error fails the test."""
    s, deadline = Stream([], [], None), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        updates = worker.poll("test", 1.0).updates
        for u in updates:
            assert u.request_id == attempt_id and u.error is None, u.error
            s.token_ids += u.token_ids
            s.deltas.append(u.text)
            s.finish_reason = u.finish_reason
            if until(u):
                return s
    raise AssertionError(f"{attempt_id}: no final update within {timeout_s} s")


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_colocated_instance_resumes(workers, reference, mode):
    w = workers["colocated"]
    params, full, cuts = reference[mode]
    prompt_ids = tuple(w.engine.tokenizer.encode(PROMPTS["ja"]))
    for k in [0, *cuts]:
        delivered, chars = tuple(full.token_ids[:k]), len(full.client_text(k))
        a = Attempt(f"c-{mode}-{k}", prompt_ids, params, "test", delivered=delivered,
                    delivered_chars=chars)  # fmt: skip
        w.add(a)
        assert_resumes(full, k, collect(w, a.id))
    assert w.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_prefill_to_decode_resumes(workers, reference, mode):
    """The decode instance reserves prompt + delivered, the prefill instance computes
    them and samples at position len(delivered), the decode instance continues."""
    p, d = workers["prefill"], workers["decode"]
    params, full, cuts = reference[mode]
    prompt_ids = tuple(d.engine.tokenizer.encode(PROMPTS["ja"]))
    for k in [0, *cuts]:
        delivered, chars = tuple(full.token_ids[:k]), len(full.client_text(k))
        a = Attempt(f"d-{mode}-{k}#0", prompt_ids, params, "test", decode=d.name,
                    delivered=delivered, delivered_chars=chars)  # fmt: skip
        destination = d.reserve(a)
        assert destination is not None
        held = d.on_loop(lambda i=a.id: len(d.engine.blocks.block_table(i)))
        assert held == d.engine.blocks.blocks_for(len(prompt_ids) + k)
        p.prefill(replace(a, destination=destination))
        resumed = collect(d, a.id)
        assert_resumes(full, k, resumed)
        collect(p, a.id, until=lambda u: u.handed_off)
    assert p.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]
    assert d.check_integrity()["free_blocks"] == CONFIG["num_kv_blocks"]
