"""The core's validation of a ``GenerateRequest`` on its own (no cluster): the checks
that no front end's wire format can reach, beside those tests/router/test_admission.py
makes through gRPC."""

from __future__ import annotations

import pytest

from pdserve.instance import feed
from pdserve.instance.messages import Attempt
from pdserve.router.request import ChatMessage, GenerateRequest, SamplingOptions
from pdserve.router.validation import InvalidRequest, ModelLimits, RequestValidator


@pytest.fixture
def validator() -> RequestValidator:
    return RequestValidator(None, ModelLimits(max_context=64, vocab_size=256, kv_tokens=512))


def test_exactly_one_input(validator):
    with pytest.raises(InvalidRequest, match="prompt: empty; send prompt, messages or"):
        validator.prompt_ids(GenerateRequest())
    both = GenerateRequest(prompt="hi", prompt_token_ids=[5])
    with pytest.raises(InvalidRequest, match="prompt, prompt_token_ids: give exactly one of"):
        validator.prompt_ids(both)
    assert validator.prompt_ids(GenerateRequest(prompt_token_ids=[5, 6])) == [5, 6]


def test_text_needs_a_tokenizer(validator):
    with pytest.raises(InvalidRequest, match="prompt: this model has no tokenizer"):
        validator.prompt_ids(GenerateRequest(prompt="hi"))


def test_sampling_unset_takes_the_defaults_and_seeds_fit_64_bits(validator):
    params = validator.sampling(GenerateRequest(prompt_token_ids=[5]))
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (16, 1.0, 0, None)
    huge = GenerateRequest(prompt_token_ids=[5], sampling=SamplingOptions(seed=2**64))
    with pytest.raises(InvalidRequest, match=r"sampling.seed=18446744073709551616: must be in"):
        validator.sampling(huge)


def test_choices_are_bounded_by_the_batch_and_the_seeds(validator):
    def sampling(**kw) -> GenerateRequest:
        return GenerateRequest(prompt_token_ids=[5], sampling=SamplingOptions(**kw))

    assert validator.sampling(sampling(n=4, seed=7)).n == 4
    limits = ModelLimits(max_context=64, vocab_size=256, kv_tokens=512, max_batch_size=8)
    with pytest.raises(InvalidRequest, match=r"sampling.n=9: more choices than .* \(max_bat"):
        RequestValidator(None, limits).sampling(sampling(n=9))
    with pytest.raises(InvalidRequest, match=r"sampling.n=17: must be an integer in \[1, 16\]"):
        validator.sampling(sampling(n=17))
    with pytest.raises(InvalidRequest, match=r"seed=9223372036854775805: must be in .* n=4\)"):
        validator.sampling(sampling(n=4, seed=2**63 - 3))
    with pytest.raises(InvalidRequest, match="sampling.n=2: prompt logprobs come with one"):
        validator.sampling(sampling(n=2, prompt_logprobs=1))


def test_integers_past_any_model_are_brought_within_the_wire_without_changing_outputs(validator):
    """The HTTP API takes top_k, max_tokens and stop_token_ids unbounded (docs/openapi.yaml):
    past any vocabulary or context they are clamped or dropped, and the attempt then
    crosses the instances' feed (msgpack: 64-bit integers at most)."""
    huge = SamplingOptions(top_k=2**90, max_tokens=2**70, stop_token_ids=[7, 2**80, -3, 255])
    params = validator.sampling(GenerateRequest(prompt_token_ids=[5], sampling=huge))
    assert (params.top_k, params.max_tokens) == (2**31 - 1, 2**31 - 1)
    assert params.stop_token_ids == [7, 255]  # the ids a 256-token vocabulary can sample
    attempt = Attempt("r#0.1", (5,), params, "router")
    assert (
        feed.decode_command(feed.encode_command("add", attempt)[feed.LENGTH.size :])[1] == attempt
    )


TEMPLATES = {
    "{{ raise_exception('roles must alternate') }}": "chat template: roles must alternate",
    "{{ messages[0].content.upper().missing.deeper }}": "(UndefinedError: ",
    "{% for m in messages %}{{ m.content + 1 }}{% endfor %}": "(TypeError: ",
    "{{ messages.__class__.__subclasses__() }}": "(SecurityError: ",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}": "(RecursionError: ",
    "{{ messages[0].content.index('zzz') }}": "failed on them (ValueError: substring not found)",
}


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_a_chat_template_failing_on_the_messages_is_invalid(tmp_path, template):
    """Whatever a model's template raises on a request's messages refuses that request
    (INVALID, naming the failure in one line), never the router."""
    from pdserve.engine.tokenizer import Tokenizer
    from tests.tiny_models import save_byte_tokenizer

    save_byte_tokenizer(tmp_path)
    backend = Tokenizer.from_folder(tmp_path, (2,)).backend
    tokenizer = Tokenizer(backend, 1, (2,), template)
    limits = ModelLimits(max_context=64, vocab_size=256, kv_tokens=512)
    request = GenerateRequest(messages=[ChatMessage("user", "hi")])
    with pytest.raises(InvalidRequest) as err:
        RequestValidator(tokenizer, limits).prompt_ids(request)
    message = str(err.value)
    assert TEMPLATES[template] in message and "\n" not in message and len(message) < 300
    unknown = GenerateRequest(messages=[ChatMessage("wizard", "hi")])
    with pytest.raises(InvalidRequest, match="messages.0..role='wizard': must be one of system"):
        RequestValidator(tokenizer, limits).prompt_ids(unknown)
