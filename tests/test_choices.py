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
from pdserve.engine.prefilled import Prefilled
from pdserve.engine.reservation import NoRoom, Reservation
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


def test_what_several_choices_refuse(tiny_model):
    llm = LLM(tiny_model("gqa2"), max_batch_tokens=64, num_kv_blocks=64, max_batch_size=4)
    engine, params = llm.engine, SamplingParams(n=2)
    with pytest.raises(ValueError, match="n=2: a resumed request .* has one choice"):
        engine.add_request("a", [3, 4], params, delivered=(5,))
    with pytest.raises(ValueError, match=r"choice_ids: 2 ids for n=2; must be n - 1 = 1"):
        engine.reserve("b", [3, 4], params, choice_ids=("b1", "b2"))
    engine.add_request("c", [3, 4], params, choice_ids=("c1",))
    with pytest.raises(ValueError, match=r"choice_ids: \['c1'\] must be distinct ids not in use"):
        engine.add_request("d", [3, 4], params, choice_ids=("c1",))
    with pytest.raises(ValueError, match="request_id='c1': already in use"):
        engine.add_request("c1", [3, 4], SamplingParams())
    with pytest.raises(ValueError, match=r"n=5: more choices than .* \(max_batch_size=4\)"):
        engine.add_request("e", [3, 4], SamplingParams(n=5))
    with pytest.raises(ValueError, match=r"n=17: must be an integer in \[1, 16\]"):
        SamplingParams(n=17)
    engine.abort_request("c")
    assert not engine.unforked
    engine.check_integrity()


def test_named_choices_are_requests_of_their_own(tiny_model):
    """The router's way: each choice named by its attempt; one aborted before the fork
    never runs, the others end under their own ids as the request alone would."""
    llm = LLM(tiny_model("gqa2"), max_batch_tokens=64, num_kv_blocks=64)
    engine, prompt = llm.engine, PROMPTS[37]
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=4, ignore_eos=True)
    engine.add_request("r", prompt, params, choice_ids=("r-1", "r-2", "r-3"))
    engine.abort_request("r-2")
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id in ("r", "r-1", "r-3")
            if o.finished:
                done[o.request_id] = o.token_ids
    engine.abort_request("r")  # ended: forked choices go on alone
    assert not engine.orphaned  # each forked, or was aborted itself
    want = {
        rid: alone(llm, prompt, params, i).token_ids
        for rid, i in (("r", 0), ("r-1", 1), ("r-3", 3))
    }
    assert done == want
    assert not engine.unforked
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == 64


@pytest.mark.parametrize("logprobs", [None, 2])
def test_choices_handed_off_fork_where_the_kv_lands(tiny_model, logprobs):
    """A hand-off request of n choices draws their first tokens with its own; the decode
    engine reserves its prompt once and forks them at ``land``: each ends as the request
    alone with its seed, and the prompt's blocks are copied across once."""
    path = tiny_model("gqa2")
    prompt = PROMPTS[37]
    params = SamplingParams(max_tokens=15, temperature=0.9, seed=7, n=3, ignore_eos=True,
                            logprobs=logprobs)  # fmt: skip
    prefill = LLM(path, max_batch_tokens=16, num_kv_blocks=64).engine
    decode = LLM(path, max_batch_tokens=64, num_kv_blocks=64)
    prefill.add_request("h", prompt, params, hand_off=True)
    left = []
    while not left:
        left = [o for o in prefill.step() if isinstance(o, Prefilled)]
    [p] = left
    assert len(p.choices) == 2 and not prefill.unforked
    reservation = decode.engine.reserve("h", prompt, params, choice_ids=("h-1", "h-2"))
    assert len(reservation.block_ids) == 3  # 37 tokens, blocks of 16: the prompt, once
    src, dst = prefill.kv_view().cache, decode.engine.kv_view().cache
    for i, j in zip(p.block_ids, reservation.block_ids, strict=True):
        dst[:, :, j] = src[:, :, i]
    firsts = decode.engine.land("h", p.first_token, p.logprobs, None, p.choices)
    assert [o.request_id for o in firsts] == ["h-1", "h-2", "h"]
    got = {o.request_id: list(o.token_ids) for o in firsts}
    while decode.engine.has_unfinished_requests():
        for o in decode.engine.step():
            got[o.request_id] = list(o.token_ids)
    for rid, i in (("h", 0), ("h-1", 1), ("h-2", 2)):
        assert got[rid] == alone(decode, prompt, params, i).token_ids, rid
    prefill.release("h")
    for e in (prefill, decode.engine):
        e.check_integrity()
        assert e.blocks.num_free_blocks == 64 and not e.unforked


def test_named_choices_of_a_request_that_ends_unforked_are_orphaned(tiny_model):
    """Named choices whose request ends before its first draw are handed to the caller
    (the instance fails them, retryable); a reservation refused for room, or a hand-off
    request that leaves with their first tokens, orphans none."""
    llm = LLM(tiny_model("gqa2"), max_batch_tokens=64, num_kv_blocks=8, max_batch_size=4)
    engine, params = llm.engine, SamplingParams(max_tokens=4, n=3)
    engine.add_request("a", [3, 4, 5], params, choice_ids=("a1", "a2"))
    engine.abort_request("a1")
    engine.abort_request("a")
    assert engine.orphaned == ["a2"] and not engine.unforked
    engine.orphaned.clear()
    assert isinstance(engine.reserve("b", [3, 4], params, choice_ids=("b1", "b2")), Reservation)
    busy = engine.reserve("c", [3, 4], SamplingParams(n=2), choice_ids=("c1",))
    assert isinstance(busy, NoRoom) and "c1" not in engine.unforked
    engine.release("b")
    assert engine.orphaned == ["b1", "b2"]
    engine.orphaned.clear()
    engine.add_request("h", [3, 4, 5], params, hand_off=True)
    while engine.has_unfinished_requests():
        engine.step()
    engine.release("h")
    assert not engine.orphaned and not engine.unforked
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == 8
