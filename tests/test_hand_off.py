"""Hand-off requests (engine/prefilled.py) in the one engine, beside requests it decodes:

- in mixed steps, a hand-off request's prompt runs in chunks with the running decodes;
  it leaves as a ``Prefilled`` carrying the first token the offline engine samples, its
  blocks held; that KV, copied into a second engine's reserved blocks
  (``reserve``, then ``land``), decodes what the offline engine does; the decoding requests are
  untouched; ``release`` frees its blocks;
- the last-chunk hook sees exactly the hand-off requests whose prompt completes in the
  step, and its per-layer callback runs once per layer of that step;
- a step that raises while KV was being sent fails every request of it (no isolation:
  their sends were under way); one without sends isolates as before.
The fault is this test's (a poisoned token id makes the real forward raise)."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.outputs import RequestOutput, StepFailed
from pdserve.engine.prefilled import Prefilled
from pdserve.engine.reservation import Reservation
from tests.test_step_isolation import POISON, poison

CONFIG = {"num_kv_blocks": 64, "max_batch_tokens": 24}  # blocks of 16 tokens
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
DECODING = {"d1": [3, 4, 5, 6, 7, 8], "d2": list(range(30, 47))}
HANDED = list(range(60, 100))  # 40 tokens: two chunks beside the decodes


@pytest.fixture(scope="module")
def offline(tiny_model):
    path = tiny_model("gqa2")
    llm = LLM(path, **CONFIG)
    prompts = {**DECODING, "h": HANDED}
    return path, {k: llm.generate(p, GREEDY)[0].token_ids for k, p in prompts.items()}


def run(engine: LLMEngine, hook=None) -> tuple[dict[str, list[int]], list[Prefilled]]:
    got: dict[str, list[int]] = {k: [] for k in DECODING}
    left: list[Prefilled] = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return got, left
        for o in engine.step(hook):
            if isinstance(o, Prefilled):
                left.append(o)
            else:
                assert isinstance(o, RequestOutput)
                got[o.request_id] += o.new_token_ids
    raise AssertionError("the engine did not finish within 200 steps")


def test_a_hand_off_leaves_at_its_first_token_and_its_kv_decodes_elsewhere(offline):
    path, want = offline
    engine = LLMEngine(path, EngineConfig(**CONFIG))
    for key, prompt in DECODING.items():
        engine.add_request(key, prompt, GREEDY)
    started = engine.step()  # both decoding requests' prompts (23 tokens) in one step
    engine.add_request("h", HANDED, GREEDY, hand_off=True)
    seen, layers = [], []

    def hook(last):
        seen.append([r.request_id for r in last])
        return layers.append, b""

    got, left = run(engine, hook)
    got = {o.request_id: o.new_token_ids + got[o.request_id] for o in started}
    assert got == {k: want[k] for k in DECODING}
    assert seen == [["h"]]  # its last chunk, once
    assert layers == list(range(engine.model.cfg.num_layers))
    [p] = left
    assert p.error is None and p.first_token == want["h"][0]
    assert p.times["prefill_start"] <= p.times["prefill_end"]
    assert "h" not in engine.requests
    assert engine.blocks.block_table("h") == p.block_ids  # held until released

    other = LLMEngine(path, EngineConfig(**CONFIG))
    reservation = other.reserve("h", HANDED, GREEDY)
    assert isinstance(reservation, Reservation)
    src, dst = engine.kv_view().cache, other.kv_view().cache
    for i, j in zip(p.block_ids, reservation.block_ids, strict=True):
        dst[:, :, j] = src[:, :, i]
    (first,) = other.land("h", p.first_token)
    tokens = list(first.new_token_ids)
    while other.has_unfinished_requests():
        tokens += [t for o in other.step() for t in o.new_token_ids]
    assert tokens == want["h"]

    engine.release("h")
    for e in (engine, other):
        e.blocks.check_integrity()
        assert e.blocks.num_free_blocks == e.blocks.num_blocks


def test_a_step_that_raises_while_sending_fails_all_its_requests(offline, monkeypatch):
    path, _ = offline
    engine = LLMEngine(path, EngineConfig(**CONFIG))
    poison(engine.model, monkeypatch)
    engine.add_request("clean", [3, 4, 5], GREEDY, hand_off=True)
    engine.add_request("poisoned", [8, POISON, 9], GREEDY, hand_off=True)
    with pytest.raises(StepFailed) as failed:
        engine.step(lambda last: ((lambda layer: None), b""))
    assert sorted(failed.value.request_ids) == ["clean", "poisoned"]
    for request_id in failed.value.request_ids:  # as the worker does
        engine.abort_request(request_id)
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    # without sends, the same step isolates: the clean request is recomputed alone
    engine.add_request("clean", [3, 4, 5], GREEDY, hand_off=True)
    engine.add_request("poisoned", [8, POISON, 9], GREEDY, hand_off=True)
    assert engine.step() == []
    assert [p.request.request_id for p in engine.step()] == ["clean"]
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["poisoned"]
    engine.abort_request("poisoned")
    engine.release("clean")
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
