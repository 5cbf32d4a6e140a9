"""Fixtures of the KV transfer tests: a peer process (the other side, for real
cross-process gloo groups), module-scoped so its start-up is paid once."""

from __future__ import annotations

import pytest

from tests.kv_transfer.helpers import Peer


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()
