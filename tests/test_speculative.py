"""Speculative decoding with prompt-lookup drafts (engine/speculative.py), offline, on
each ISA the CPU has: greedy output equals the same engine without speculation, token
for token, beside sampled requests and chunked prompts, under preemption, with the
prefix cache reusing blocks a verified step wrote, within max_tokens and the stops;
drafts are verified (more than one token in a step) and every block is free after."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.guessers import make_guesser
from pdserve.engine.request import Request
from pdserve.engine.speculative import (
    PROBE_EVERY,
    Guesses,
    accepted,
    draft_length,
    guesses_per_request,
    propose,
)

pytestmark = pytest.mark.usefixtures("isa")


def test_larger_batches_guess_less_then_not_at_all():
    assert [guesses_per_request(4, n) for n in (0, 1, 2, 3, 8)] == [3, 3, 1, 0, 0]
    assert guesses_per_request(1, 1) == 1 and guesses_per_request(0, 1) == 0


def test_a_request_guesses_as_far_as_its_recent_rate_pays():
    fresh = Guesses()
    assert draft_length(fresh, 4) == 4  # before any verification
    held, half, missed = Guesses(), Guesses(), Guesses()
    for _ in range(10):
        held.verified(4, 4)
        half.verified(2, 1)
        missed.verified(2, 0)
    assert (half.guessed, half.accepted, half.steps) == (20, 10, 10)
    assert [draft_length(g, 4) for g in (held, half, missed)] == [4, 1, 0]
    missed.idle = PROBE_EVERY  # long enough without: one guess again
    assert draft_length(missed, 4) == 1 and draft_length(missed, 0) == 0


def guessed(guesser, tokens: list[int], k: int, rid: str = "r") -> list[int]:
    return guesser.guess(Request(rid, tokens, SamplingParams()), k)


def test_suffix_decoding_follows_the_continuation_seen_most():
    g = make_guesser("suffix")
    assert guessed(g, [1, 2, 3, 4, 5, 1, 2, 3], 2) == [4, 5]
    assert guessed(g, [7, 8, 9], 2) == []  # nothing seen before
    # 8 was followed by 1 twice and 2 once: 1 holds two thirds; after 8, 1 it was 6
    assert guessed(g, [8, 1, 6, 8, 1, 6, 8, 2, 5, 8], 3) == [1, 6, 8]
    assert guessed(g, [4, 1, 4, 2, 4, 3, 4], 1, rid="split") == []  # none has half
    # across requests: an output that ended here is guessed for a later request
    done = Request("a", [50, 51], SamplingParams())
    done.token_ids += [60, 61, 62, 63, 64]
    g.ended(done)
    assert guessed(g, [70, 51, 60, 61], 3, rid="b") == [62, 63, 64]
    assert "a" not in g.own


def test_propose_takes_what_followed_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 9, 1, 2, 3], 2) == [9, 9]
    assert propose([5, 1, 2, 7, 1, 2, 8, 4, 2], 3) == [8, 4, 2]  # g=1: the latest 2
    assert propose([1, 2, 3, 4], 4) == []
    assert propose([4, 4, 4, 4], 3) == [4]  # what follows the latest match, up to the end
    assert accepted([5, 6, 7], [5, 6, 1, 2]) == 2
    assert accepted([5], [4, 5]) == 0


def prompts(n: int = 8) -> list[list[int]]:
    """Prompts with repeated spans (drafts hold there) and without."""
    rng = random.Random(3)
    out = []
    for i in range(n):
        span = [rng.randrange(3, 256) for _ in range(rng.choice([4, 9, 20]))]
        noise = [rng.randrange(3, 256) for _ in range(rng.choice([1, 7, 30]))]
        out.append(span * (1 + i % 3) + noise + span[: 1 + i % 5])
    return out


def run(path: str, k: int, params, **config) -> tuple[list[list[int]], int, int]:
    """The outputs of ``prompts()``, how many requests' drafts were verified, and the
    prompt tokens the engine computed."""
    llm = LLM(path, speculative_tokens=k, **config)
    engine, runner, verified = llm.engine, llm.engine.runner, []
    verify = runner._verify

    def spy(logits, spec):
        verified.append(len(spec))
        return verify(logits, spec)

    runner._verify = spy
    for i, (prompt, p) in enumerate(zip(prompts(), params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    computed = engine.stats().computed_prompt_tokens
    return [got[f"r{i}"] for i in range(len(params))], sum(verified), computed


@pytest.mark.parametrize("k, method", [(1, "ngram"), (4, "ngram"), (4, "suffix")])
@pytest.mark.parametrize("blocks", [256, 12])
@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_output_is_the_plain_engines(tiny_model, k, blocks, batch, method):
    """Greedy requests of several lengths (eos counts), two sampled ones beside them,
    16-token chunks, one or two running at once (the row budget leaves no guesses to
    larger batches); with 12 blocks requests are preempted and recomputed."""
    path = tiny_model("gqa2")
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=i % 2 == 0)
              for i, m in enumerate([40, 7, 60, 1, 33, 50])]  # fmt: skip
    params += [SamplingParams(max_tokens=30, temperature=0.8, seed=s) for s in (1, 2)]
    config = dict(max_batch_tokens=16, num_kv_blocks=blocks, max_batch_size=batch)
    want, _, _ = run(path, 0, params, **config)
    got, verified, _ = run(path, k, params, speculative_method=method, **config)
    assert got == want
    assert [len(g) for g in got[:6]][::2] == [40, 60, 33]  # max_tokens held exactly
    assert verified > 5  # drafts went through verification


def test_a_model_that_repeats_its_input_takes_several_tokens_a_step():
    """The embedded model asked to repeat a text: most steps confirm guesses, and the
    output is the plain engine's."""
    text = (
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
        "with a single step. All that glitters is not gold, and fortune favors the bold. "
        "Where there is a will, there is a way."
    )
    conversation = [{"role": "user", "content": "Repeat this text exactly:\n" + text}]
    greedy = SamplingParams(max_tokens=64, temperature=0)
    outs = []
    for k in (0, 4):
        llm = LLM("smollm2-135m", speculative_tokens=k, num_kv_blocks=128)
        engine = llm.engine
        engine.add_request("r", llm.tokenizer.apply_chat_template(conversation), greedy)
        tokens, steps = [], 0
        while engine.has_unfinished_requests():
            new = [t for o in engine.step() for t in o.new_token_ids]
            steps += bool(new)
            tokens += new
        outs.append((tokens, steps))
        engine.check_integrity()
    (plain, plain_steps), (fast, fast_steps) = outs
    assert fast == plain and plain_steps == len(plain)
    assert fast_steps < len(plain) / 2, (fast_steps, len(plain))


def test_blocks_a_verified_step_wrote_serve_later_prompts(tiny_model):
    """The prefix cache registers a verified request's blocks only up to its accepted
    tokens: a later prompt that is that request's prompt and output reuses them and
    continues as the plain engine does."""
    path = tiny_model("gqa2")
    first = prompts()[0]
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outs = {}
    for k in (0, 4):
        llm = LLM(path, speculative_tokens=k, num_kv_blocks=64)
        a = llm.generate([first], greedy)[0]
        b = llm.generate([first + a.token_ids], greedy)[0]
        assert b.num_cached_tokens > len(first)
        outs[k] = (a.token_ids, b.token_ids)
        llm.engine.check_integrity()
    assert outs[4] == outs[0]


def test_a_speculative_engine_config_is_checked():
    with pytest.raises(ValueError, match=r"speculative_tokens=17: must be an integer in \[0, 16\]"):
        LLM("unused", speculative_tokens=17)


def test_sampled_output_is_the_plain_engines(tiny_model):
    """Seeded sampled requests (temperature, top-k, top-p) draw each verified row as the
    plain request draws that position: the output is the plain engine's, token for
    token, whatever was guessed."""
    path = tiny_model("gqa2")
    params = [SamplingParams(max_tokens=40, temperature=t, top_k=k, top_p=p, seed=s,
                             ignore_eos=True)
              for s, (t, k, p) in enumerate([(0.8, 0, 1.0), (1.3, 5, 1.0), (0.5, 0, 0.7),
                                             (1.0, 2, 0.9)] * 2)]  # fmt: skip
    config = dict(max_batch_tokens=16, num_kv_blocks=256, max_batch_size=1)
    want, _, computed = run(path, 0, params, **config)
    got, verified, computed_guessing = run(path, 3, params, **config)
    assert got == want and verified > 5
    assert computed_guessing == computed  # rejected guesses are no prompt tokens
