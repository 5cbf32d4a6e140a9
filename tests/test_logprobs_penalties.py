"""Logprobs and penalties in the engine's sampler against HF transformers on the same
weights (a tiny random Llama): logprobs are HF's log-softmax of the raw logits, with the
same most likely tokens in the same order; repetition_penalty picks what HF's
``RepetitionPenaltyLogitsProcessor`` + argmax picks; presence and frequency penalties
(HF has no processor for them) what OpenAI's documented formula picks, applied here by
hand to HF's logits. A resumed request (``delivered``) continues exactly, penalties and
logprobs included."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

PROMPTS = [[5, 9, 23, 77, 101, 4], [40] * 3 + [41, 42, 43] * 4, list(range(100, 140))]
STEPS = 24


@pytest.fixture(scope="module")
def models(tiny_model):
    """HF's model and ours, on one torch thread while this module runs: the reference
    loops run hundreds of tiny forward passes, which a second thread only slows down."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tiny_model("gqa2")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield hf, LLM(path, max_batch_tokens=64, num_kv_blocks=128)
    torch.set_num_threads(threads)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """HF's logits [len(ids), vocab] of every position of ``ids``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_logprobs_of(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's log-softmax [len(output), vocab] of the distributions ``output`` was drawn from."""
    logits = hf_logits(hf, prompt + output)[len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1)


def greedy(**penalties) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, **penalties)


def test_greedy_logprobs_equal_hf_log_softmax(models):
    hf, llm = models
    asks = [0, 5, 20]
    params = [greedy(logprobs=k) for k in asks] + [greedy()]
    outs = llm.generate([*PROMPTS, PROMPTS[0]], params)
    for ids, out, k in zip(PROMPTS, outs, asks, strict=False):
        ref = hf_logprobs_of(hf, ids, out.token_ids)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(ours, ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=0)  # fmt: skip
        top = ref.topk(k, dim=-1)
        assert [list(lp.top_ids) for lp in out.logprobs] == top.indices.tolist()
        got = torch.tensor([lp.top_logprobs for lp in out.logprobs]).reshape(top.values.shape)
        torch.testing.assert_close(got, top.values, atol=1e-4, rtol=0)
        if k:  # greedy: the chosen token is the most likely one
            assert all(lp.top_ids[0] == lp.token_id for lp in out.logprobs)
    # a request that does not ask gets none, and asking changes no token
    assert outs[-1].logprobs is None and outs[-1].token_ids == outs[0].token_ids


def test_logprobs_are_of_the_raw_distribution_whatever_the_sampling(models):
    """Temperature, top-k, top-p and penalties change the choice, not the logprobs: they
    stay HF's log-softmax of the raw logits at the tokens drawn."""
    hf, llm = models
    p = SamplingParams(max_tokens=STEPS, temperature=0.7, top_k=40, top_p=0.9, seed=11,
                       presence_penalty=0.5, repetition_penalty=1.2, logprobs=2,
                       ignore_eos=True)  # fmt: skip
    out = llm.generate(PROMPTS[1], p)[0]
    ref = hf_logprobs_of(hf, PROMPTS[1], out.token_ids)
    ours = torch.tensor([lp.logprob for lp in out.logprobs])
    torch.testing.assert_close(ours, ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0],
                               atol=1e-4, rtol=0)  # fmt: skip
    # some draws were not the most likely token (else this would test greedy again)
    assert any(lp.top_ids[0] != lp.token_id for lp in out.logprobs)


def hf_greedy_with(hf, prompt: list[int], process) -> list[int]:
    """Greedy decoding over HF's logits, each step's last row changed by
    ``process(sequence so far, output so far, row)`` before the argmax."""
    seq, out = list(prompt), []
    for _ in range(STEPS):
        row = hf_logits(hf, seq)[-1].clone()
        token = int(process(seq, out, row).argmax())
        seq.append(token)
        out.append(token)
    return out


def hf_repetition(penalty: float):
    from transformers import RepetitionPenaltyLogitsProcessor

    processor = RepetitionPenaltyLogitsProcessor(penalty)
    return lambda seq, out, row: processor(torch.tensor([seq]), row[None])[0]


def openai_penalties(presence: float, frequency: float):
    """OpenAI's documented formula, over the output tokens so far:
    ``mu[j] -= c[j] * frequency + (c[j] > 0) * presence``."""

    def apply(seq, out, row):
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=row.numel())
        return row - counts * frequency - (counts > 0).float() * presence

    return apply


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_picks_what_hf_processor_picks(models, penalty):
    hf, llm = models
    outs = llm.generate(PROMPTS, greedy(repetition_penalty=penalty))
    plain = llm.generate(PROMPTS, greedy())
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy_with(hf, ids, hf_repetition(penalty))
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain, strict=True))


@pytest.mark.parametrize(
    "presence,frequency,repetition",
    [(1.5, 0.0, 1.0), (0.0, 1.0, 1.0), (-0.5, 0.7, 1.0), (0.4, 0.3, 1.3)],
)
def test_presence_and_frequency_follow_openai_formula(models, presence, frequency, repetition):
    """HF has no presence/frequency processor: the reference applies OpenAI's formula to
    HF's logits (after HF's repetition processor when both are set, vLLM's order)."""
    hf, llm = models
    params = greedy(presence_penalty=presence, frequency_penalty=frequency,
                    repetition_penalty=repetition)  # fmt: skip
    outs = llm.generate(PROMPTS, params)
    plain = llm.generate(PROMPTS, greedy())
    rep, oai = hf_repetition(repetition), openai_penalties(presence, frequency)
    for ids, out in zip(PROMPTS, outs, strict=True):
        want = hf_greedy_with(hf, ids, lambda seq, o, row: oai(seq, o, rep(seq, o, row)))
        assert out.token_ids == want
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain, strict=True))


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_a_resumed_request_continues_exactly(models, mode):
    """A request resumed from its first k output tokens (``delivered``, as after a
    migration) draws the same tokens with the same logprobs: the penalties count the
    delivered tokens, seeded draws stay keyed by output position."""
    _, llm = models
    temperature, seed = (0, None) if mode == "greedy" else (0.9, 5)
    params = SamplingParams(max_tokens=STEPS, temperature=temperature, seed=seed,
                            frequency_penalty=1.5, presence_penalty=0.5,
                            repetition_penalty=1.2, logprobs=3, ignore_eos=True)  # fmt: skip
    full = llm.generate(PROMPTS[0], params)[0]
    engine = llm.engine
    for k in (1, 9, STEPS - 1):
        engine.add_request(f"resume-{mode}-{k}", PROMPTS[0], params, tuple(full.token_ids[:k]))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[-1].finished and outs[-1].token_ids == full.token_ids
        # prompt + delivered are prefilled at once, not decoded one by one: the logits,
        # and so the logprobs, agree to float32 rounding, the choices exactly
        resumed = [lp for o in outs for lp in o.new_logprobs]
        assert [lp.top_ids for lp in resumed] == [lp.top_ids for lp in full.logprobs[k:]]
        for got, want in zip(resumed, full.logprobs[k:], strict=True):
            assert got.token_id == want.token_id
            assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-5)
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
    # without the delivered history the penalties differ, and so does the continuation
    cold = llm.generate(PROMPTS[0] + full.token_ids[:9], params)[0]
    assert cold.token_ids != full.token_ids[9:][: len(cold.token_ids)]
