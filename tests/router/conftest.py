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


@pytest.fixture(scope="package")
def api(cluster):
    """The official ``openai`` client on the cluster's HTTP API."""
    import openai

    client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused")
    yield client
    client.close()


@pytest.fixture(scope="package")
def http(cluster):
    """A plain HTTP client on the cluster's HTTP API (bodies the ``openai`` client would
    not send)."""
    import httpx

    with httpx.Client(base_url=f"http://{cluster.http_address}", timeout=60) as c:
        yield c
