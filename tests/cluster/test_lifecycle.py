"""What ends a cluster's service, on a cluster of its own (so no other test sees what
it did): a drain. (An instance killed under its streams: test_supervision.py.)"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tests.cluster.helpers import small_cluster_config, wait_until
from tests.cluster.test_launch import health


@pytest.fixture
def cluster(chat_model):
    from pdserve.cluster import launch

    with launch(small_cluster_config(chat_model, policy="round_robin")) as c:
        yield c


def test_drain_reports_not_serving_and_finishes_in_flight_requests(cluster):
    client = cluster.client()
    stream = client.generate(prompt_token_ids=[9] * 50, max_tokens=900, ignore_eos=True)
    first = next(stream)
    drained = {}
    drainer = threading.Thread(target=lambda: drained.update(cut=cluster.drain(timeout_s=60)))
    drainer.start()
    assert wait_until(lambda: health(cluster.address) == "NOT_SERVING", timeout_s=5)
    with pytest.raises(grpc.RpcError) as err:
        client.complete("late", max_tokens=1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert drainer.is_alive()  # still waiting for the stream
    rest = list(stream)
    drainer.join(timeout=30)
    assert drained == {"cut": 0}
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 900
    t0 = time.monotonic()
    assert health(cluster.address) == "NOT_SERVING"
    assert time.monotonic() - t0 < 5
