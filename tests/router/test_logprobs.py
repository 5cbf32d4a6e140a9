"""Logprobs and penalties through a real cluster (the folder's co-located one): the
official ``openai`` client parses OpenAI's logprobs objects from completions and chat,
streaming and not, and ``RouterClient`` gets ``TokenLogprobs`` over gRPC, all equal to
the offline engine's; bad values are refused naming the field; ``top_k=-1`` is off.
(Disaggregated requests: tests/cluster/test_disagg.py, against the same offline run.)"""

from __future__ import annotations

import grpc
import openai
import pytest

from pdserve.engine import LLM, SamplingParams

IDS = [5, 9, 33, 81, 17, 4, 60]
MESSAGES = [{"role": "user", "content": "Name a colour."}]
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.4}
VLLM_EXTRAS = {"repetition_penalty": 1.3, "ignore_eos": True}


def params(logprobs: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0, logprobs=logprobs, **PENALTIES,
                          **VLLM_EXTRAS)  # fmt: skip


@pytest.fixture(scope="module")
def offline(chat_model):
    llm = LLM(chat_model)
    return llm, llm.generate(IDS, params(3))[0], llm.chat(MESSAGES, params(2))[0]


def text_of(tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def assert_same_numbers(got: list[float], want: list[float]) -> None:
    assert got == pytest.approx(want, abs=1e-5)


def test_completions_logprobs_in_openai_legacy_shape(api, chat_model, offline):
    llm, want, _ = offline
    tok = llm.tokenizer
    kwargs = dict(model=chat_model, prompt=IDS, max_tokens=8, temperature=0, logprobs=3,
                  **PENALTIES, extra_body=VLLM_EXTRAS)  # fmt: skip
    lp = api.completions.create(**kwargs).choices[0].logprobs
    tokens = [text_of(tok, t) for t in want.token_ids]
    assert lp.tokens == tokens
    assert_same_numbers(lp.token_logprobs, [x.logprob for x in want.logprobs])
    assert lp.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for top, x in zip(lp.top_logprobs, want.logprobs, strict=True):
        expected: dict[str, float] = {}  # the 3 most likely by text, then the sampled one
        pairs = [*zip(x.top_ids, x.top_logprobs, strict=True), (x.token_id, x.logprob)]
        for token_id, value in pairs:
            expected.setdefault(text_of(tok, token_id), value)
        assert list(top) == list(expected)
        assert_same_numbers(list(top.values()), list(expected.values()))
    chunks = list(api.completions.create(**kwargs, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [d for s in streamed for d in s.top_logprobs] == lp.top_logprobs


def test_chat_logprobs_in_openai_content_shape(api, chat_model, offline):
    llm, _, want = offline
    tok = llm.tokenizer
    kwargs = dict(model=chat_model, messages=MESSAGES, max_tokens=8, temperature=0,
                  logprobs=True, top_logprobs=2, **PENALTIES, extra_body=VLLM_EXTRAS)  # fmt: skip
    content = api.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert [c.bytes for c in content] == [list(tok.token_bytes(t)) for t in want.token_ids]
    assert [c.token for c in content] == [text_of(tok, t) for t in want.token_ids]
    assert_same_numbers([c.logprob for c in content], [x.logprob for x in want.logprobs])
    for c, x in zip(content, want.logprobs, strict=True):
        assert [t.bytes for t in c.top_logprobs] == [list(tok.token_bytes(i)) for i in x.top_ids]
        assert_same_numbers([t.logprob for t in c.top_logprobs], list(x.top_logprobs))
    chunks = list(api.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip

    # the same shape and tokens; the numbers within float32 noise: the repeated prompt's
    # KV now comes from the prefix cache, computed in another chunking
    def shape(entries):
        return [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in entries]

    assert shape(streamed) == shape(content)
    for s, c in zip(streamed, content, strict=True):
        assert_same_numbers([s.logprob] + [t.logprob for t in s.top_logprobs],
                            [c.logprob] + [t.logprob for t in c.top_logprobs])  # fmt: skip


def test_no_logprobs_unless_asked(api, chat_model):
    done = api.completions.create(model=chat_model, prompt=IDS, max_tokens=2)
    assert done.choices[0].logprobs is None
    chat = api.chat.completions.create(model=chat_model, messages=MESSAGES, max_tokens=2)
    assert chat.choices[0].logprobs is None


def test_grpc_logprobs_per_chunk(client, offline):
    _, want, _ = offline
    kwargs = dict(prompt_token_ids=IDS, max_tokens=8, temperature=0, logprobs=3, **PENALTIES,
                  **VLLM_EXTRAS)  # fmt: skip
    chunks = list(client.generate(**kwargs))
    assert all(len(c.logprobs or []) == len(c.token_ids) for c in chunks)
    got = [x for c in chunks for x in c.logprobs or []]
    assert [c for c in chunks if c.token_ids] and [x.token_id for x in got] == want.token_ids
    assert [x.top_ids for x in got] == [x.top_ids for x in want.logprobs]
    assert_same_numbers([x.logprob for x in got], [x.logprob for x in want.logprobs])
    assert client.complete(**kwargs).logprobs == got
    assert client.complete(prompt_token_ids=IDS, max_tokens=2).logprobs is None


def test_top_k_minus_one_is_off(api, chat_model, client):
    seeded = dict(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True)
    off = client.complete(prompt_token_ids=IDS, top_k=0, **seeded).token_ids
    assert client.complete(prompt_token_ids=IDS, top_k=-1, **seeded).token_ids == off
    assert client.complete(prompt_token_ids=IDS, top_k=2, **seeded).token_ids != off
    extra = {"top_k": -1, "seed": 4, "ignore_eos": True}
    done = api.completions.create(model=chat_model, prompt=IDS, max_tokens=6, temperature=0.9,
                                  extra_body=extra)  # fmt: skip
    assert done.usage.completion_tokens == 6


@pytest.mark.parametrize(
    "chat,body,needle",
    [
        (False, {"logprobs": 21}, "logprobs=21: must be unset or an integer in [0, 20]"),
        (False, {"logprobs": True}, "logprobs=True: must be an integer"),
        (True, {"logprobs": 2}, "logprobs=2: must be true or false"),
        (True, {"top_logprobs": 2}, "top_logprobs=2: needs logprobs: true"),
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs=21: must be an integer"),
        (False, {"presence_penalty": 2.5}, "presence_penalty=2.5: must be a number in [-2, 2]"),
        (True, {"frequency_penalty": "x"}, "frequency_penalty='x': must be a number"),
        (False, {"repetition_penalty": 0}, "repetition_penalty=0.0: must be a number in"),
        (False, {"top_k": -2}, "top_k=-2: must be an integer >= -1"),
        (False, {"prompt_logprobs": 21}, "prompt_logprobs=21: must be an integer in [0, 20]"),
        (True, {"prompt_logprobs": -1}, "prompt_logprobs=-1: must be an integer in [0, 20]"),
    ],
)
def test_bad_values_are_refused_naming_the_field(api, chat_model, chat, body, needle):
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            api.chat.completions.create(model=chat_model, messages=MESSAGES, extra_body=body)
        else:
            api.completions.create(model=chat_model, prompt=IDS, extra_body=body)
    assert needle in err.value.body["message"]


def test_bad_grpc_values_are_invalid_argument(client):
    for kwargs, needle in [
        ({"logprobs": -1}, "sampling.logprobs=-1"),
        ({"repetition_penalty": 200.0}, "sampling.repetition_penalty=200.0"),
        ({"frequency_penalty": float("nan")}, "sampling.frequency_penalty=nan"),
        ({"prompt_logprobs": 21}, "sampling.prompt_logprobs=21"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            client.complete(prompt_token_ids=IDS, max_tokens=2, **kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()
