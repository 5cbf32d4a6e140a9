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


@pytest.fixture(scope="module")
def shared_ray():
    """One embedded Ray (the machine's CPUs, as ``launch`` would start) that the module's
    clusters run on in turn: ``launch`` uses a Ray the caller started and leaves it
    running, so each cluster saves Ray's start and stop. Use it through ``on_shared_ray``,
    which gives each test a Ray as a fresh one would be: no named actor left of the
    test before, every CPU free."""
    from pdserve.cluster.config import RayConfig
    from pdserve.cluster.ray_env import RaySession

    session = RaySession(RayConfig())
    session.start()
    yield
    session.stop()


@pytest.fixture
def on_shared_ray(shared_ray):
    """Run this test's clusters on the module's Ray; after it, wait (bounded) until its
    actors and placement groups are gone, and fail the test when they are not."""
    import ray

    from tests.cluster.helpers import wait_until

    total = ray.cluster_resources()["CPU"]
    yield

    def clean():
        return not ray.util.list_named_actors() and ray.available_resources().get("CPU") == total

    assert wait_until(clean, 30, interval_s=0.1), (
        ray.util.list_named_actors(),
        ray.available_resources(),
    )
