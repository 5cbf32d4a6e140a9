"""A step that raises fails only the request that caused it: the engine runs each
request of the failed step again alone, the one whose own step still fails is failed
(``StepFailed``), the others finish exactly as in a clean run. The fault is this
test's: the real model's forward raises whenever a poisoned token id is in its input."""

from __future__ import annotations

import time

import pytest

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.outputs import StepFailed
from pdserve.instance.messages import Attempt
from pdserve.instance.worker import EngineWorker

POISON = 250
PROMPTS = {"a": [3, 4, 5, 6, 7], "poisoned": [8, 9, POISON, 10], "c": list(range(20, 60))}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CONFIG = {"num_kv_blocks": 64, "max_batch_tokens": 32}


def poison(model, monkeypatch) -> None:
    """The model's forward raises for any batch holding ``POISON`` (never generated
    here: the clean outputs are checked not to contain it)."""
    forward = model.forward

    def poisoned(input_ids, *args, **kwargs):
        if (input_ids == POISON).any():
            raise RuntimeError("poisoned input")
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", poisoned)


@pytest.fixture(scope="module")
def clean(tiny_model):
    path = tiny_model("gqa2")
    llm = LLM(path, **CONFIG)
    out = {k: llm.generate(p, GREEDY)[0].token_ids for k, p in PROMPTS.items() if k != "poisoned"}
    assert all(POISON not in ids for ids in out.values())
    return path, out


def test_the_engine_fails_only_the_request_that_breaks_its_steps(clean, monkeypatch):
    path, want = clean
    engine = LLMEngine(path, EngineConfig(**CONFIG))
    poison(engine.model, monkeypatch)
    for key, prompt in PROMPTS.items():
        engine.add_request(key, prompt, GREEDY)
    got, failed, steps = {k: [] for k in PROMPTS}, [], 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 500
        try:
            outputs = engine.step()
        except StepFailed as e:
            failed += e.request_ids
            for request_id in e.request_ids:
                engine.abort_request(request_id)
            continue
        for o in outputs:
            got[o.request_id] += o.new_token_ids
    assert failed == ["poisoned"]
    assert {k: got[k] for k in want} == want
    assert not engine.scheduler.suspects
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_an_instance_reports_the_failed_request_alone_and_serves_the_rest(clean, monkeypatch):
    path, want = clean
    worker = EngineWorker("colocated-0", path, CONFIG, 1)
    try:
        poison(worker.engine.model, monkeypatch)
        for key, prompt in PROMPTS.items():
            worker.add(Attempt(key, tuple(prompt), GREEDY, "test"))
        got, errors, finished = {k: [] for k in want}, {}, set()
        deadline = time.monotonic() + 120
        while len(errors) + len(finished) < len(PROMPTS):
            assert time.monotonic() < deadline, (got, errors)
            updates = worker.poll("test", 1.0).updates
            for u in updates:
                if u.error is not None:
                    errors[u.request_id] = u.error
                    continue
                got[u.request_id] += u.token_ids
                if u.finish_reason is not None:
                    finished.add(u.request_id)
        assert got == want
        assert list(errors) == ["poisoned"] and "incident" in errors["poisoned"]
        assert "poisoned input" not in errors["poisoned"]  # in the log, not the update
        blocks = worker.check_integrity()
        assert blocks["free_blocks"] == blocks["total_blocks"]
    finally:
        worker.stop()
