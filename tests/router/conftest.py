"""Fixtures of the router tests: one real local cluster (Ray and gRPC on loopback) for
the whole folder, on a tiny model with a tokenizer."""

from __future__ import annotations

import pytest

from tests.cluster.helpers import make_chat_model, small_cluster_config


@pytest.fixture(scope="package")
def chat_model(tmp_path_factory) -> str:
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="package")
def cluster(chat_model):
    from pdserve.cluster import launch

    c = launch(small_cluster_config(chat_model))
    yield c
    c.shutdown(drain=False)


@pytest.fixture(scope="package")
def client(cluster):
    from pdserve.router.client import RouterClient

    with RouterClient(cluster.address) as c:
        yield c
