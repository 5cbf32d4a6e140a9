"""Resuming a request from the tokens its client already received (LLMEngine).

For greedy and seeded sampling, with and without a stop string, a request resumed with
``delivered`` = the first k tokens of an uninterrupted run and ``delivered_chars`` = the
characters its client had, continues with exactly the rest of that run: tokens, text
(held-back stop prefixes and split UTF-8 characters included) and finish reason.
"""

from __future__ import annotations

import itertools

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from tests.resume_utils import (
    PROMPTS,
    assert_resumes,
    cut_points,
    mid_char_cuts,
    sampling,
    stop_string_of,
    stream_of,
    streams_of,
)

_ids = itertools.count()


@pytest.fixture(scope="module")
def engine():
    # a small token budget: prompt + delivered is prefilled over several chunks
    return LLMEngine("smollm2-135m", EngineConfig(num_kv_blocks=128, max_batch_tokens=32))


def run(engine, *args, **kwargs):
    return stream_of(engine, f"r{next(_ids)}", *args, **kwargs)


@pytest.mark.parametrize("with_stop", [False, True], ids=["no-stop", "stop"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("lang", ["en", "ja"])
def test_resumed_request_continues_the_uninterrupted_run(engine, lang, mode, with_stop):
    prompt = PROMPTS[lang]
    params = sampling(mode)
    full = run(engine, prompt, params)
    if with_stop:
        params = sampling(mode, [stop_string_of(full)])
        full = run(engine, prompt, params)
        assert full.finish_reason == "stop" and len(full.token_ids) >= 4
    else:
        assert full.finish_reason == "length" and len(full.token_ids) == params.max_tokens
    tok = engine.tokenizer
    cuts = cut_points(full, len(tok.encode(prompt)), engine.blocks.block_size, tok)
    if lang == "ja" and not with_stop:
        assert mid_char_cuts(tok, full.token_ids), "no cut inside a character was tried"
    held = 0
    resumes = []  # every cut's resumed request, run together in one batch
    for k in cuts:
        client = full.client_text(k)
        held = max(held, len(tok.decode(full.token_ids[:k])) - len(client))
        resumes.append((f"r{next(_ids)}", prompt, params, full.token_ids[:k], len(client)))
    for k, resumed in zip(cuts, streams_of(engine, resumes), strict=True):
        assert_resumes(full, k, resumed)
    if with_stop:
        assert held > 0, "no cut where the client's text lagged the tokens was tried"
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_resumed_request_survives_preemption(engine):
    """Preempted, a resumed request is recomputed from prompt + delivered + what it
    generated since, and still continues the uninterrupted run."""
    prompt, params = PROMPTS["ja"], sampling("seeded")
    full = run(engine, prompt, params)
    k = len(full.token_ids) // 2
    # 6 blocks of 16 tokens: the two requests cannot both reach 60 tokens
    tight = LLMEngine("smollm2-135m", EngineConfig(num_kv_blocks=6, max_batch_tokens=32))
    tight.add_request("other", prompt, sampling("greedy"))
    resumed = stream_of(tight, "r", prompt, params, full.token_ids[:k], len(full.client_text(k)))
    assert_resumes(full, k, resumed)
    assert resumed.preemptions > 0
    while tight.has_unfinished_requests():
        tight.step()
    tight.blocks.check_integrity()
    assert tight.blocks.num_free_blocks == tight.blocks.num_blocks


@pytest.mark.parametrize(
    "delivered, chars, params, match",
    [
        ([5] * 40, 0, SamplingParams(max_tokens=40), "max_tokens=40; a resumed request"),
        ([5, 2], 0, SamplingParams(max_tokens=9), "holds token 2, which stops"),
        ([5, 7], 0, SamplingParams(max_tokens=9, stop_token_ids=[7]), "holds token 7"),
        ([5, 2], 0, SamplingParams(max_tokens=9, ignore_eos=True), None),
        ([5], 99, SamplingParams(max_tokens=9), "delivered_chars=99: .* must be in"),
        ([5], -1, SamplingParams(max_tokens=9), "delivered_chars=-1"),
        ([49152], 0, SamplingParams(max_tokens=9), r"delivered: token ids must be in \[0"),
        ([5] * 8200, 0, SamplingParams(max_tokens=9000), "prompt \\+ delivered \\(8200\\)"),
    ],
)
def test_resume_refuses_what_cannot_continue(engine, delivered, chars, params, match):
    if match is None:
        engine.add_request("ok", "Hi", params, tuple(delivered), chars)
        engine.abort_request("ok")
        return
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", "Hi", params, tuple(delivered), chars)
    assert "bad" not in engine.requests and "bad" not in engine.detokenizers


def test_delivered_text_holding_a_stop_string_is_refused(engine):
    ids = engine.tokenizer.encode(" Paris is lovely")
    params = SamplingParams(max_tokens=20, stop=["is lov"])
    with pytest.raises(ValueError, match="holds the stop string 'is lov'"):
        engine.add_request("bad", "Hi", params, tuple(ids), 0)
    assert "bad" not in engine.requests
