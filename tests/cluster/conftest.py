"""Fixtures of the cluster tests: a tiny model with a tokenizer (written once a session)."""

from __future__ import annotations

import pytest

from tests.cluster.helpers import make_chat_model


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    """Folder of a tiny random Llama with a byte-level tokenizer and a chat template."""
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))
