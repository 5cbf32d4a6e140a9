"""An outsider on the KV plane, run as its own OS process by test_closed_by_default.py
and test_grpc_kv_gate.py: it knows a decode receiver's address, a real prefill
instance's name and a live transfer token, but not the cluster's secret (nor, under
mTLS, a certificate of the cluster's CA). Once started it prints ``ready``, waits for a
line on its stdin, attacks, and prints one JSON line: what each attack got. ``idle``
prints ``opened`` once its streams are open, and holds them open after its JSON line
until a second line.

    python -m tests.cluster.kv_attacker gloo|grpc|idle ADDRESS PREFILL_NAME TOKEN
"""

from __future__ import annotations

import datetime
import json
import secrets
import sys
import time

HUGE = 1 << 40  # a header's block count


def gloo(address: str, name: str) -> dict:
    from torch.distributed import PrefixStore, TCPStore

    from kv_transfer import gloo_wire as wire
    from kv_transfer import kv_transfer_pb2 as pb
    from kv_transfer.gloo_wire import GlooGroup, Kind

    host, port = wire.split_address(address)
    store = TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
    card = pb.ReceiverCard.FromString(store.get("kv/receiver"))

    def join(who: str) -> pb.Join:
        j = pb.Join(name=who, rank=0, gen=secrets.token_hex(16), proof=secrets.token_bytes(32))
        j.layout.CopyFrom(card.layout)
        store.queue_push("kv/joins", j.SerializeToString())
        return j

    # a spoofed join under the real prefill instance's name, then the group it would form
    spoof = join(name)
    formed = False
    try:
        prefix = f"pair/{spoof.name}/{spoof.rank}/{spoof.gen}"
        pg = GlooGroup.make_group(
            PrefixStore(prefix, store), 0, host, datetime.timedelta(seconds=3)
        )
        formed = True
        # a header announcing 2^40 blocks, sent only if a pair was (wrongly) formed
        h = wire.header(Kind.DATA, 1, 0, 0)
        h[wire.H_NSEGS] = 1
        h[wire.HEAD + wire.S_COUNT] = HUGE
        import torch

        pg.send([torch.tensor(h, dtype=torch.int64)], 1, wire.TAG_HDR).wait()
    except Exception:  # noqa: BLE001 - refused: no pair
        pass
    for i in range(100):  # bogus joins in a row
        join(f"bogus-{i}")
    return {"pair_formed": formed, "bogus_sent": 100}


def grpc_(address: str, token: str) -> dict:
    import grpc

    from kv_transfer import kv_transfer_pb2 as pb
    from kv_transfer.grpc_sender import CHANNEL_OPTIONS, METHOD

    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    call = channel.stream_unary(
        METHOD, request_serializer=pb.KVChunk.SerializeToString,
        response_deserializer=pb.PushAck.FromString,
    )  # fmt: skip

    def push(tok: str, count: int) -> str:
        head = pb.KVChunk(transfer_id=tok, nonce=secrets.token_bytes(16),
                          proof=secrets.token_bytes(32), data=b"\0" * 4096)  # fmt: skip
        head.meta.add(layer=0, block_offset=0, num_blocks=count, head_start=0, head_end=1)
        end = pb.KVChunk(end=True)
        return pb.PushAck.Status.Name(call(iter([head, end]), timeout=10).status)

    answers = {"live_token": push(token, (1 << 32) - 1)}
    answers["bogus"] = sorted({push(secrets.token_hex(16), 1) for _ in range(100)})
    channel.close()
    return answers


IDLE = {"bare": 60, "forged": 20, "replayed": 20}  # idle streams, by their opening


def idle(address: str, name: str) -> dict:
    """100 streams that send no message: opened with no proof, a forged one, or one
    forged opening used 20 times; what each got (its answer or its error code), whether
    any was answered with the receiver's proof, and the bytes of every answer."""
    import threading

    import grpc

    from kv_transfer import grpc_gate as gate
    from kv_transfer import kv_transfer_pb2 as pb
    from kv_transfer.grpc_sender import CHANNEL_OPTIONS, METHOD

    hold = threading.Event()

    class Idle:
        def __iter__(self):
            return self

        def __next__(self):
            hold.wait(600)
            raise StopIteration

    def forged() -> tuple:
        ms = str(int(time.time() * 1000))
        proof = secrets.token_bytes(32)
        return ((gate.SENDER, name), (gate.TIME, ms),
                (gate.CHALLENGE, secrets.token_bytes(16)), (gate.PROOF, proof))  # fmt: skip

    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    call = channel.stream_unary(METHOD, request_serializer=pb.KVChunk.SerializeToString,
                                response_deserializer=None)  # fmt: skip
    replayed = forged()
    openings = [None] * IDLE["bare"] + [forged() for _ in range(IDLE["forged"])]
    openings += [replayed] * IDLE["replayed"]
    calls = [call.future(Idle(), metadata=md) for md in openings]
    print("opened", flush=True)
    got: dict[str, list[str]] = {kind: [] for kind in IDLE}
    kinds = [k for k, n in IDLE.items() for _ in range(n)]
    answered, nbytes = False, 0
    for kind, f in zip(kinds, calls, strict=True):
        try:
            raw = f.result(timeout=60)
            nbytes += len(raw)
            got[kind].append(pb.PushAck.Status.Name(pb.PushAck.FromString(raw).status))
        except grpc.RpcError as e:
            got[kind].append(e.code().name)
        answered = answered or gate.ANSWER in dict(f.initial_metadata() or ())
    out = {k: sorted(set(v)) for k, v in got.items()}
    out.update(answered=answered, answer_bytes=nbytes)
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # the streams stay open until told
    hold.set()
    channel.close()
    return {"closed": True}


if __name__ == "__main__":
    backend, address, name, token = sys.argv[1:5]
    import grpc  # noqa: F401 - imported before "ready", so that the attack starts at once
    import torch  # noqa: F401

    print("ready", flush=True)
    sys.stdin.readline()
    if backend == "idle":
        out = idle(address, name)
    else:
        out = gloo(address, name) if backend == "gloo" else grpc_(address, token)
    print(json.dumps(out), flush=True)
