"""Fixtures of the structured-output tests: the tiny chat model (a byte tokenizer)."""

from __future__ import annotations

import pytest

from tests.cluster.helpers import make_chat_model


@pytest.fixture(scope="package")
def chat_model(tmp_path_factory) -> str:
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))
