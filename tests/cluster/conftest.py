"""Fixtures of the cluster tests: a tiny model with a tokenizer (written once a session)."""

from __future__ import annotations

import pytest

from tests.cluster.helpers import make_chat_model


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    """Folder of a tiny random Llama with a byte-level tokenizer and a chat template."""
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="session")
def kv4_model(tmp_path_factory) -> str:
    """A tiny random Llama with 4 KV heads (every tensor-parallel split of its heads) and a
    byte tokenizer, saved as a HF folder."""
    from tests.tiny_models import TINY_SHAPES, save_byte_tokenizer, save_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-kv4")
    save_tiny_llama(folder, **TINY_SHAPES["kv4"])
    save_byte_tokenizer(folder)
    return str(folder)
