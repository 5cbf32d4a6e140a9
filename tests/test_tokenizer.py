"""Our GGUF tokenizer and chat template against transformers' reading of the same file."""

from __future__ import annotations

import pytest

from pdserve.engine.checkpoint import alias_path, load_checkpoint
from pdserve.engine.detokenizer import Detokenizer

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces, trailing   \n\n\ttabs and newlines\n",
    "Numbers: 3.14159, 2024-11-29, 1,000,000 and 42nd.",
    "def add(a, b):\n    return a + b  # sum\n",
    "Unicode: naïve café, 東京, emoji 🚀🔥, Ελληνικά.",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def ours():
    return load_checkpoint("smollm2-135m").tokenizer


@pytest.fixture(scope="module")
def theirs():
    from transformers import AutoTokenizer

    gguf = alias_path("smollm2-135m")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(ours, theirs):
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    for messages in (chat, chat[1:2]):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected


def test_incremental_detokenizer_rebuilds_multibyte_text(ours):
    text = TEXTS[4]
    ids = ours.encode(text)
    detok = Detokenizer(ours, stop=[])
    streamed = ""
    for i in range(1, len(ids) + 1):
        detok.update(ids[:i])
        streamed += detok.delta(final=i == len(ids))
    assert streamed == text == detok.text
