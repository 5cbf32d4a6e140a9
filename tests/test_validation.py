"""Invalid arguments raise ValueError naming the argument and the reason."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("gqa2"), num_kv_blocks=128)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(temperature=float("inf")), "temperature=inf"),
        (dict(temperature=-0.0), "temperature=-0.0"),
        (dict(temperature=1e-40), "temperature=1e-40: must be 0 .greedy. or at least"),
        (dict(top_p=float("nan")), "top_p=nan"),
        (dict(top_p=-0.0), "top_p"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), r"top_k=-2: must be an integer >= -1 \(0 and -1 disable it\)"),
        (dict(stop=[""]), "stop"),
        (dict(logprobs=21), r"logprobs=21: must be unset or an integer in \[0, 20\]"),
        (dict(logprobs=-1), "logprobs=-1"),
        (dict(logprobs=True), "logprobs=True"),
        (dict(presence_penalty=2.5), r"presence_penalty=2.5: must be a number in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty=nan"),
        (dict(frequency_penalty=-3), "frequency_penalty=-3"),
        (dict(repetition_penalty=0), r"repetition_penalty=0: must be a number in \[0.01, 100\]"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty=inf"),
        (dict(repetition_penalty="2"), "repetition_penalty='2'"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_top_k_off_and_penalty_bounds_are_accepted():
    for top_k in (-1, 0):
        assert SamplingParams(top_k=top_k).top_k == top_k
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=100)
    assert p.penalized and not SamplingParams(repetition_penalty=1.0).penalized
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=20)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt: empty"):
        llm.generate([[]])


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match=r"prompt: 1024 tokens, the context holds 1024"):
        llm.generate([[5] * 1024])


def test_token_ids_out_of_vocab(llm):
    with pytest.raises(ValueError, match=r"prompt: token ids must be in \[0, 256\)"):
        llm.generate([[5, 300]])


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")


def test_failed_batch_leaves_no_request_behind(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], []])
    assert not llm.engine.has_unfinished_requests()
    llm.engine.blocks.check_integrity()


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match=r"model='.*nowhere': not found"):
        LLM(str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype="int8"), "dtype='int8'"),
        (dict(block_size=0), "block_size=0"),
        (dict(max_batch_tokens=-4), "max_batch_tokens=-4"),
        (dict(attention_backend="magic"), "attention_backend='magic'"),
    ],
)
def test_bad_engine_arguments(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model("gqa2"), **kwargs)


def test_prompt_larger_than_the_cache(tiny_model):
    small = LLM(tiny_model("gqa2"), num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[5] * 40])
