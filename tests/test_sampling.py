"""Sampling parameters: seeds, top-k/top-p limits, stops and finish reasons."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.sampler import NUCLEUS_PROBE, _candidates, _inverse_cdf


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("gqa2"), num_kv_blocks=256, max_batch_tokens=64)


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2-135m", num_kv_blocks=256)


PROMPT = [5, 9, 23, 77, 101, 4]


def test_seed_gives_same_output_whatever_the_batch(llm):
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].token_ids
    noise = SamplingParams(max_tokens=20, temperature=1.3, ignore_eos=True)
    others = [[7, 8, 9], [11] * 30, [200, 3]]
    batch = llm.generate([others[0], PROMPT, *others[1:]], [noise, seeded, noise, noise])
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    assert llm.generate(PROMPT, other_seed)[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0))[0].token_ids
    for p in (
        SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=3),
        SamplingParams(max_tokens=16, temperature=0.8, top_p=1e-6, seed=3),
    ):
        assert llm.generate(PROMPT, p)[0].token_ids == greedy


def test_candidates_keep_the_right_tokens():
    def kept(logits, **cut) -> list[int]:
        weights, ids = _candidates(logits, 1.0, **cut)
        tokens = range(len(weights)) if ids is None else ids.tolist()
        return sorted(t for t, w in zip(tokens, weights.tolist(), strict=True) if w > 0)

    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    assert kept(logits, top_k=2, top_p=1.0) == [0, 2]
    full = torch.softmax(logits, -1)
    # top_p just above the largest probability keeps the two largest
    assert kept(logits, top_k=0, top_p=float(full[0]) + 1e-3) == [0, 2]
    assert kept(logits, top_k=0, top_p=1e-30) == [0]  # the first, always
    # past NUCLEUS_PROBE tokens: a flat row whose nucleus is most of the vocabulary (the
    # whole row sorted) and a peaked one whose nucleus is two tokens (only the probe)
    flat = torch.zeros(4 * NUCLEUS_PROBE)
    assert len(kept(flat, top_k=0, top_p=0.5)) == 2 * NUCLEUS_PROBE
    peaked = flat.clone()
    peaked[[7, 900]] = 30.0
    assert kept(peaked, top_k=0, top_p=0.9) == [7, 900]
    assert kept(peaked, top_k=1, top_p=1.0) in ([7], [900], [7, 900])  # a tie: both stay


def test_inverse_cdf_never_draws_a_zero_weight():
    gen = torch.Generator().manual_seed(0)
    weights = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    drawn = {_inverse_cdf(weights, gen) for _ in range(2000)}
    assert drawn == {1, 3}
    assert _inverse_cdf(torch.tensor([0.0, 0.0, 1e-45]), gen) == 2


def test_sampling_follows_the_distribution(llm):
    """With temperature 1 and no cut, token frequencies approach softmax(logits): across
    a seeded request's output positions, and across draws of an unseeded one."""
    from pdserve.engine.request import Request

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for seed in (0, None):
        request = Request("r", [1], SamplingParams(temperature=1.0, seed=seed))
        counts = torch.zeros(4)
        for _ in range(4000):
            token = llm.engine.runner.sampler(logits, [request])[0]
            counts[token] += 1
            request.token_ids.append(token)  # the next draw is at the next position
        expected = torch.softmax(logits[0], -1)
        torch.testing.assert_close(counts / 4000, expected, atol=0.03, rtol=0)


def test_seeded_draw_depends_on_seed_and_position_only(llm):
    """The draw at output position p is the same whatever came before it, in whichever
    sampler (process) draws it; another position or seed draws independently."""
    from pdserve.engine.request import Request
    from pdserve.engine.sampler import Sampler, position_seed

    assert position_seed(1234567, 0) == 6457827717110365317  # splitmix64's first output
    assert position_seed(1234567, 1) == 3203168211198807973
    logits = torch.zeros(1, 256)

    def draws(sampler, output, seed=7):
        request = Request("r", [1], SamplingParams(temperature=1.0, seed=seed))
        out = []
        for token in [*output, None]:
            out.append(sampler(logits, [request])[0])
            request.token_ids.append(token)  # the history, not the draw, moves on
        return out

    first = draws(llm.engine.runner.sampler, [3] * 20)
    assert draws(Sampler(seed=99), [200] * 20) == first  # other history, other process
    assert len(set(first)) > 10  # not one stream's repeated first draw
    assert draws(Sampler(), [3] * 20, seed=8) != first


def test_max_tokens_and_stop_token_ids(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    stop_at = out.token_ids[3]
    first = out.token_ids.index(stop_at)
    p = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    stopped = llm.generate(PROMPT, p)[0]
    assert stopped.token_ids == out.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_eos_and_ignore_eos(smol):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol.chat(chat, SamplingParams(max_tokens=40, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert out.text == "The capital of France is Paris."
    more = smol.chat(chat, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert more.finish_reason == "length" and len(more.token_ids) == 40


def test_stop_string_truncates_text_and_stream(smol):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = smol.tokenizer.apply_chat_template(chat)
    params = SamplingParams(max_tokens=40, temperature=0, stop=["France is"])
    engine = smol.engine
    engine.add_request("s", prompt, params)
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_text
            final = out
    assert final.finish_reason == "stop"
    assert final.text == "The capital of " and streamed == final.text
