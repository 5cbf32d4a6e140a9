"""A request's guide in the engine (engine/structured.py): the output matches its regex,
choice, JSON schema or Lark grammar; a resumed request's matcher, rebuilt from its
delivered tokens, continues exactly as an uninterrupted run; unguided requests sharing
the batch are unchanged; specs that cannot compile are refused naming what is wrong."""

from __future__ import annotations

import json
import re

import jsonschema
import msgpack
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.structured import Guide, GuideError

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 5},
        "b": {"enum": ["x", "y"]},
        "c": {
            "type": "array",
            "items": {"type": "integer", "maximum": 99, "minimum": 0},
            "maxItems": 3,
        },
        "d": {"type": "boolean"},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
GUIDES = {
    "regex": Guide("regex", "[a-z]{12}-[0-9]{2}"),
    "choice": Guide("choice", json.dumps(["alpha", "beta", "gamma"])),
    "json": Guide("json", json.dumps(SCHEMA)),
    "grammar": Guide("grammar", 'start: "(" num ")" | "(" num "," num ")"\nnum: /[0-9]{1,3}/'),
}
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [9] * 20, [100, 3, 77, 12, 5]]


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(chat_model)


def params(guide: Guide | None, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 96, "temperature": 0, "guide": guide, **kw})


def matches(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(GUIDES["regex"].spec, text) is not None
    if kind == "choice":
        return text in json.loads(GUIDES["choice"].spec)
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    return re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})?\)", text) is not None


@pytest.mark.parametrize("kind", GUIDES)
def test_the_output_matches_its_guide_greedy_and_sampled(llm, kind):
    outs = llm.generate(PROMPTS, params(GUIDES[kind]))
    outs += llm.generate(PROMPTS, [params(GUIDES[kind], temperature=1.0, seed=s) for s in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", (kind, out.text)
        assert matches(kind, out.text), (kind, out.text)


def test_a_greedy_row_is_masked_only_when_its_argmax_leaves_the_grammar(llm, monkeypatch):
    """A greedy guided row whose argmax the grammar allows skips its mask (``allows``);
    the tokens are those of the row masked every step, and some masks were skipped."""
    from pdserve.engine.structured import Matcher

    work = [params(g, ignore_eos=True) for g in GUIDES.values()]
    fills = []
    fill = Matcher.fill
    monkeypatch.setattr(Matcher, "fill", lambda self, row: fills.append(1) or fill(self, row))
    lazy = llm.generate(PROMPTS, work)
    skipped = sum(len(o.token_ids) for o in lazy) - len(fills)
    monkeypatch.setattr(Matcher, "allows", lambda self, token: False)
    masked = llm.generate(PROMPTS, work)
    assert [o.token_ids for o in lazy] == [o.token_ids for o in masked]
    assert skipped > 0
    for kind, out in zip(GUIDES, lazy, strict=True):
        assert matches(kind, out.text), (kind, out.text)


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_a_resumed_request_continues_its_grammar_where_it_was(llm, kind):
    """The delivered tokens are replayed into a fresh matcher: the rest is what the
    uninterrupted run produced, greedy and seeded."""
    for extra in ({}, {"temperature": 0.9, "seed": 3}):
        whole = llm.generate([PROMPTS[0]], params(GUIDES[kind], **extra))[0]
        for cut in (1, 5, len(whole.token_ids) - 1):
            delivered = tuple(whole.token_ids[:cut])
            rid = f"resume-{kind}-{cut}-{bool(extra)}"
            llm.engine.add_request(rid, PROMPTS[0], params(GUIDES[kind], **extra), delivered)
            rest = []
            while llm.engine.has_unfinished_requests():
                rest += [t for o in llm.engine.step() for t in o.new_token_ids]
            assert list(delivered) + rest == whole.token_ids, (kind, cut)
    llm.engine.check_integrity()


def test_delivered_tokens_that_leave_the_grammar_are_refused(llm):
    tok = llm.tokenizer
    with pytest.raises(ValueError, match="delivered: its tokens do not fit the choice guide"):
        llm.engine.add_request(
            "bad", PROMPTS[0], params(GUIDES["choice"]), tuple(tok.encode("zeta"))
        )


def test_unguided_requests_in_the_batch_are_unchanged(llm):
    alone = llm.generate(PROMPTS, params(None, ignore_eos=True))
    mixed = llm.generate(
        PROMPTS * 2,
        [params(None, ignore_eos=True)] * 4 + [params(g) for g in GUIDES.values()],
    )
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    for kind, out in zip(GUIDES, mixed[4:], strict=True):
        assert matches(kind, out.text), (kind, out.text)


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    out = llm.generate([PROMPTS[1]], params(GUIDES["choice"], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text in json.loads(GUIDES["choice"].spec)


@pytest.mark.parametrize(
    ("guide", "message"),
    [
        (dict(kind="json", spec='{"type": "nonsense"}'), "json: .*nonsense"),
        (dict(kind="json", spec="[1, 2]"), "json schema: must be a JSON object"),
        (dict(kind="json", spec="{not json"), "json schema: not valid JSON"),
        (dict(kind="regex", spec="(unclosed"), "regex: "),
        (dict(kind="choice", spec='["a", 3]'), "choice: .* must be a list of non-empty strings"),
        (dict(kind="grammar", spec="start: undefined_rule"), "grammar: "),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_naming_it(llm, guide, message):
    with pytest.raises(GuideError, match=message):
        llm.engine.grammars().compile(Guide(**guide))
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("x", PROMPTS[0], params(Guide(**guide)))
    assert "x" not in llm.engine.requests


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(kind="xml", spec="a"), "guide.kind='xml': must be one of json, regex, choice"),
        (dict(kind="regex", spec=""), "guide.spec='': must be a non-empty string"),
        (dict(kind="regex"), "guide="),
    ],
)
def test_a_guide_is_checked_when_made(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(guide=fields)


def test_the_guide_crosses_a_wire_as_plain_data():
    p = SamplingParams(max_tokens=3, guide=GUIDES["json"])
    back = SamplingParams(**msgpack.unpackb(msgpack.packb(p.as_dict()), raw=False))
    assert back == p and back.guide == GUIDES["json"]


def test_compiled_guides_are_kept_and_copied_per_request(llm):
    grammars = llm.engine.grammars()
    first = grammars.compile(GUIDES["regex"])
    assert grammars.compile(Guide("regex", GUIDES["regex"].spec)) is first
    a, b = grammars.matcher(GUIDES["regex"]), grammars.matcher(GUIDES["regex"])
    a.consume(llm.tokenizer.encode("q")[0])
    bits = torch.empty(8, dtype=torch.int32)  # the 256 tokens' bits
    b.fill(bits)
    dash = ord("-")
    assert a.inner is not b.inner and not (bits[dash // 32] >> dash % 32) & 1


def test_a_temperature_past_float32_samples_only_what_the_grammar_allows(llm):
    """Found by the fuzzer: such a temperature divides to inf, and -inf / inf is NaN."""
    out = llm.generate([PROMPTS[0]], params(GUIDES["choice"], temperature=1e308))[0]
    assert out.finish_reason == "stop" and matches("choice", out.text)


def test_a_guide_the_vocabulary_cannot_spell_ends_its_request_alone(llm):
    """The tiny byte tokenizer has no token for the byte 0x01 (ids 0-2 are its special
    tokens): a choice that needs it is a dead end after the first token. That request
    ends with an error naming the guide and emits nothing past the dead end; the others
    of the batch are unchanged."""
    assert "\x01" not in llm.tokenizer.decode(list(range(3, 256)))
    dead = Guide("choice", json.dumps(["a\x01b"]))
    alone = llm.generate(PROMPTS[:2], params(None, ignore_eos=True))
    for rid, prompt, p in [("dead", PROMPTS[0], params(dead))] + [
        (f"ok{i}", prompt, params(None, ignore_eos=True)) for i, prompt in enumerate(PROMPTS[:2])
    ]:
        llm.engine.add_request(rid, prompt, p)
    ends = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                ends[out.request_id] = out
    assert ends["dead"].finish_reason == "abort" and ends["dead"].text == "a"
    assert re.search(
        "the choice guide: after 1 output tokens no token of the model's", ends["dead"].error
    )
    assert [ends["ok0"].token_ids, ends["ok1"].token_ids] == [o.token_ids for o in alone]
    llm.engine.check_integrity()
