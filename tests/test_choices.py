"""Several choices of one request (``SamplingParams.n``, engine/choices.py), offline:
each choice is the request run alone with its own seed (seed + i), token for token and
logprob for logprob, guided or not; the prompt is computed once (the forward passes'
prompt tokens counted) and its full blocks shared, the partial one copied; a choice
preempted, or forked with no block free, is recomputed and still ends the same; an
abort ends them all; every block is free after each scenario."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.structured import Guide
from tests.cluster.helpers import make_chat_model

# every test on each ISA the CPU has (tests/conftest.py isa)
pytestmark = pytest.mark.usefixtures("isa")
PROMPTS = {n: list(range(3, 3 + n)) for n in (37, 32)}  # a partial last block, and none


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def counted(llm: LLM) -> list[int]:
    """Each forward pass's prompt tokens (items past a request's first decode are not
    counted), recorded as ``llm`` runs."""
    runner, seen = llm.engine.runner, []
    run = runner.run

    def spy(batch, *args, **kwargs):
        seen.append(sum(n for r, n in batch.items if r.num_computed_tokens < r.num_prompt_tokens))
        return run(batch, *args, **kwargs)

    runner.run = spy
    return seen


def alone(llm: LLM, prompt: list[int], params: SamplingParams, i: int):
    seed = None if params.seed is None else params.seed + i
    return llm.generate([prompt], SamplingParams(**{**params.as_dict(), "n": 1, "seed": seed}))[0]


@pytest.mark.parametrize("length", sorted(PROMPTS))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_each_choice_is_the_request_alone_with_its_seed(tiny_model, length, temperature):
    llm = LLM(tiny_model("gqa2"), max_batch_tokens=16, num_kv_blocks=64)
    prompt = PROMPTS[length]
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=11, n=4,
                            ignore_eos=True, logprobs=2)  # fmt: skip
    prompt_tokens = counted(llm)
    outs = llm.generate([prompt], params)
    assert sum(prompt_tokens) == length  # computed once, for the four
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert {o.request_id for o in outs} == {outs[0].request_id}
    for i, out in enumerate(outs):
        want = alone(llm, prompt, params, i)
        assert out.token_ids == want.token_ids, i
        assert [lp.token_id for lp in out.logprobs] == want.token_ids
        got_lp = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got_lp, torch.tensor([lp.logprob for lp in want.logprobs]))
    if temperature:
        assert len({tuple(o.token_ids) for o in outs}) > 1
    llm.engine.check_integrity()
    assert llm.engine.blocks.num_free_blocks == 64


def test_guided_choices_follow_their_grammar(chat_model):
    llm = LLM(chat_model, num_kv_blocks=64)
    guide = Guide("regex", "[a-z]{12}")
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=3, guide=guide)
    outs = llm.generate([[7, 19, 33]], params)
    for i, out in enumerate(outs):
        assert out.token_ids == alone(llm, [7, 19, 33], params, i).token_ids
        assert len(out.text) == 12 and out.text.isalpha() and out.finish_reason == "stop"
    llm.engine.check_integrity()


@pytest.mark.parametrize("blocks", [4, 6])
def test_choices_preempted_or_forked_without_a_free_block_end_the_same(tiny_model, blocks):
    """The prompt takes three blocks of 16, each choice one more per 16 tokens of output
    (57 tokens: four blocks alone), so the choices run out of blocks, are preempted and
    recomputed; with four blocks, two of the three forks find none free and start
    waiting."""
    path = tiny_model("gqa2")
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=2, n=4, ignore_eos=True)
    prompt = PROMPTS[37]
    roomy = LLM(path, max_batch_tokens=64, num_kv_blocks=64)
    want = [o.token_ids for o in roomy.generate([prompt], params)]
    tight = LLM(path, max_batch_tokens=64, num_kv_blocks=blocks, block_size=16)
    got = tight.generate([prompt], params)
    assert [o.token_ids for o in got] == want
    assert [o.finish_reason for o in got] == ["length"] * 4
    assert tight.engine.scheduler.num_preemptions > 0
    tight.engine.check_integrity()
    assert tight.engine.blocks.num_free_blocks == blocks


def test_an_abort_ends_every_choice(tiny_model):
    llm = LLM(tiny_model("gqa2"), max_batch_tokens=64, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("x", PROMPTS[37], SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    seen: set[int] = set()
    while len(seen) < 3:
        seen |= {o.index for o in engine.step()}
    engine.step()
    engine.abort_request("x")
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == 64


def test_what_several_choices_do_not_do_yet_is_refused(tiny_model):
    llm = LLM(tiny_model("gqa2"), max_batch_tokens=64, num_kv_blocks=64, max_batch_size=4)
    engine, params = llm.engine, SamplingParams(n=2)
    with pytest.raises(ValueError, match="n=2: a request of several choices is not handed off"):
        engine.add_request("a", [3, 4], params, hand_off=True)
    with pytest.raises(ValueError, match="n=2: a request of several choices is not reserved"):
        engine.reserve("b", [3, 4], params)
    with pytest.raises(ValueError, match=r"n=5: more choices than .* \(max_batch_size=4\)"):
        engine.add_request("c", [3, 4], SamplingParams(n=5))
    with pytest.raises(ValueError, match=r"n=17: must be an integer in \[1, 16\]"):
        SamplingParams(n=17)
    engine.check_integrity()
