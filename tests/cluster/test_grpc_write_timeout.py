"""A gRPC client that stops reading a stream (a real grpc channel whose call is never
read past its first message): HTTP/2 flow control holds the router's writes, and after
``router.write_timeout_s`` the router ends the call (DEADLINE_EXCEEDED naming the key)
and takes the request out, while the client still reads nothing; a client that reads
is served meanwhile."""

from __future__ import annotations

import grpc
import pytest

from router import pdserve_pb2 as pb
from router import pdserve_pb2_grpc as pb_grpc
from tests.cluster.helpers import small_cluster_config, wait_until

WRITE_TIMEOUT_S = 2.0
MAX_TOKENS = 900  # with 20 alternatives per token: ~150 KB a stream
STREAMS = 32  # on one connection, unread: past every window and buffer


def request(max_tokens: int, logprobs: int | None) -> pb.GenerateRequest:
    sampling = pb.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if logprobs is not None:
        sampling.logprobs = logprobs
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(5, 25))),
                              sampling=sampling)  # fmt: skip


@pytest.mark.timeout(300)
def test_a_stream_its_client_stops_reading_is_ended_after_write_timeout_s(chat_model):
    from cluster import launch

    config = small_cluster_config(chat_model, write_timeout_s=WRITE_TIMEOUT_S)
    with launch(config) as cluster:
        # no BDP probing: the stream's window stays grpc's initial one while unread
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        with grpc.insecure_channel(cluster.address, options=options) as channel:
            stub = pb_grpc.RouterStub(channel)
            calls = [stub.Generate(request(MAX_TOKENS, 20), timeout=120) for _ in range(STREAMS)]
            call = calls[0]
            first = next(call)
            assert first.token_ids
            # the client reads nothing more; the router gives up on it and frees its place
            ended = wait_until(lambda: cluster.stats()["in_flight"] == 0, 60, interval_s=0.2)
            assert ended, cluster.stats()
            # meanwhile (and after) a client that reads is served in full
            with grpc.insecure_channel(cluster.address) as other:
                got = list(pb_grpc.RouterStub(other).Generate(request(8, None), timeout=60))
            assert got[-1].finish_reason == "length"
            assert sum(len(m.token_ids) for m in got) == 8
            # what was buffered arrives, then the error: the stream never finished
            tokens = len(first.token_ids)
            with pytest.raises(grpc.RpcError) as e:
                for m in call:
                    tokens += len(m.token_ids)
                    assert not m.finish_reason
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
            assert f"router.write_timeout_s={WRITE_TIMEOUT_S:g} s" in e.value.details()
            assert tokens < MAX_TOKENS
