"""Decode instances that prefill for each other (hybrid mode without a prefill pool,
docs/serving.md "Hybrid mode"), through the instances' own entry points in this
process, a real KV transfer over gRPC and gloo:

- decode-1 decodes requests of its own while it prefills a prompt for decode-0 (its
  chunks ride in the same mixed steps); decode-0 decodes that prompt from the landed
  KV; both decode exactly what the offline engine does, and decode-1's handoff reports
  the bytes decode-0 received;
- then the other way round, over the same pair of instances;
- a job aborted while prefilling, and a prefill refused (its id in use there), hold nothing;
  every block is free and ``check_integrity()`` holds on both after each scenario.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from pdserve.decode_worker import Receiving
from pdserve.engine import LLM, SamplingParams
from pdserve.instance.messages import Attempt, Update
from tests.kv_transfer.helpers import WORKER_KV
from tests.roles import part, worker

CONFIG = {"num_kv_blocks": 64, "max_batch_tokens": 32}  # blocks of 16 tokens
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)  # outlast the peer's
OWN = {"own-a": (3, 4, 5, 6, 7, 8, 9), "own-b": tuple(range(120, 139))}
PEER = tuple(3 + (11 * i) % 200 for i in range(70))  # 70 tokens: 3 chunks beside decodes


@pytest.fixture(scope="module", params=["grpc", "gloo"])
def pair(tiny_model, request):
    threads, path = torch.get_num_threads(), tiny_model("gqa2")
    kv = {**WORKER_KV, "backend": request.param}
    d0 = worker("decode", "decode-0", path, CONFIG, 1, kv, peers=True)
    d1 = worker("decode", "decode-1", path, CONFIG, 1, kv, peers=True)
    yield d0, d1
    d0.stop()
    d1.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(tiny_model("gqa2"), **CONFIG)
    out = {k: llm.generate(list(p), LONG)[0].token_ids for k, p in OWN.items()}
    return {**out, "peer": llm.generate(list(PEER), PARAMS)[0].token_ids}


def collect(workers, wanted: set[str], timeout_s: float = 60) -> dict[str, list[Update]]:
    """Every update of the ``wanted`` ids (``<instance>:<request id>``) on the workers'
    ``test`` outboxes, until each has its final one (an end, an error or a hand-off)."""
    got: dict[str, list[Update]] = {k: [] for k in wanted}
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while done != wanted:
        assert time.monotonic() < deadline, (got, done)
        for w in workers:
            for u in w.poll("test", 0.2).updates:
                key = f"{w.name}:{u.request_id}"
                got.setdefault(key, []).append(u)
                if u.final or u.handed_off or u.error is not None:
                    done.add(key)
    return got


def assert_all_free(*workers) -> None:
    for w in workers:
        blocks = w.check_integrity()  # raises when the accounting is off
        assert blocks["free_blocks"] == blocks["total_blocks"] == CONFIG["num_kv_blocks"]


def tokens(updates: list[Update]) -> list[int]:
    assert updates[-1].error is None, updates[-1].error
    return [t for u in updates for t in u.token_ids]


@pytest.mark.parametrize("direction", ["1-for-0", "0-for-1"])
def test_a_decode_instance_prefills_for_its_peer_beside_its_own_decodes(pair, offline, direction):
    d0, d1 = pair
    decoder, prefiller = (d0, d1) if direction == "1-for-0" else (d1, d0)
    tag = f"{part(decoder, Receiving).transport.name}-{direction}"
    own = {f"{k}-{tag}#0": p for k, p in OWN.items()}
    # hold the prefiller's loop after its first step that decodes both its own requests,
    # and let it go once the peer's prompt waits in its inbox: the next steps carry both
    holding, go = threading.Event(), threading.Event()

    def hold(shape, seconds, stats) -> None:  # on the prefiller's loop, after a step
        if shape.decodes == 2 and not holding.is_set():
            holding.set()
            go.wait(30)

    prefiller.step_observers.append(hold)
    try:
        for rid, prompt in own.items():
            prefiller.add(Attempt(rid, prompt, LONG, "test"))
        assert holding.wait(30)
        prefiller.step_log()  # drained: the steps from here on carry the peer's prompt
        rid = f"peer-{tag}#0"
        a = Attempt(rid, PEER, PARAMS, "test", prefill=prefiller.name, decode=decoder.name)
        raw = decoder.reserve(a)
        assert raw is not None
        prefiller.prefill(replace(a, destination=raw))
    finally:
        go.set()
        prefiller.step_observers.remove(hold)
    wanted = {f"{decoder.name}:{rid}", f"{prefiller.name}:{rid}"}
    wanted |= {f"{prefiller.name}:{r}" for r in own}
    got = collect([d0, d1], wanted)
    # the peer's prompt chunks rode in steps with the prefilling instance's own decodes
    # (its own prompts were computed before the hold): [prompt tokens, _, decodes, ...]
    assert any(row[0] > 0 and row[2] == 2 for row in prefiller.step_log())
    for r in own:
        assert tokens(got[f"{prefiller.name}:{r}"]) == offline[r.split("-" + tag)[0]]
    decoded = got[f"{decoder.name}:{rid}"]
    assert tokens(decoded) == offline["peer"]
    [handed] = got[f"{prefiller.name}:{rid}"]
    assert handed.handed_off and handed.info["kv_bytes"] == decoded[0].info["kv_bytes"] > 0
    assert decoded[0].info["prefill_instance"] == prefiller.name
    assert_all_free(d0, d1)


def test_an_aborted_peer_prefill_and_a_refused_one_hold_nothing(pair):
    d0, d1 = pair
    tag = part(d0, Receiving).transport.name
    rid = f"abort-{tag}#0"
    a = Attempt(rid, PEER, PARAMS, "test", prefill=d1.name, decode=d0.name)
    raw = d0.reserve(a)
    d1.prefill(replace(a, destination=raw))
    d1.abort([rid])
    d0.abort([rid])
    # the same id again on the instance that decodes it: refused, nothing kept
    b = Attempt(f"dup-{tag}#0", PEER, PARAMS, "test", decode=d0.name)
    raw = d0.reserve(b)
    d0.prefill(replace(b, destination=raw))
    [refused] = collect([d0], {f"decode-0:dup-{tag}#0"})[f"decode-0:dup-{tag}#0"]
    assert refused.error and "already in use" in refused.error and not refused.retryable
    d0.abort([b.id])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            assert_all_free(d0, d1)
            return
        except AssertionError:
            time.sleep(0.1)
    assert_all_free(d0, d1)
