"""An outsider on the KV plane, run as its own OS process by test_closed_by_default.py
and test_grpc_kv_gate.py: it knows a decode receiver's address, a real prefill
instance's name, a live transfer token and (gloo) the decode instance's tensor-parallel
rendezvous, but not the cluster's secret (nor, under mTLS, a certificate of the
cluster's CA). Once started it prints ``ready``, waits for a line on its stdin,
attacks, and prints one JSON line: what each attack got. ``idle`` prints ``opened``
once its streams are open, and holds them open after its JSON line until a second line.

    python -m tests.cluster.kv_attacker gloo|grpc|idle ADDRESS PREFILL_NAME TOKEN [TP_ADDRESS]
"""

from __future__ import annotations

import contextlib
import datetime
import json
import secrets
import socket
import sys
import threading
import time

FLOOD = 4 << 20  # bytes of each flooding value


def _store_attacks(address: str, name: str) -> dict:
    """torch's own store client against a rendezvous, one connection per attack: read
    the card (to pose as the receiver), pop the joins (to take a prefill instance's
    pair), overwrite the card, push a spoofed join, and 64 values of 4 MiB. Each runs
    on a thread of its own, bounded: torch's client retries with back-offs."""
    from torch.distributed import TCPStore

    from pdserve.kv_transfer import gloo_wire as wire
    from pdserve.kv_transfer import kv_transfer_pb2 as pb

    host, port = wire.split_address(address)
    spoof = pb.Join(name=name, rank=0, gen=secrets.token_hex(16), proof=secrets.token_bytes(32))
    attacks = {
        "read_card": lambda s: s.get("kv/receiver"),
        "pop_join": lambda s: s.queue_pop("kv/joins", False),
        "overwrite_card": lambda s: s.set("kv/receiver", b"forged card"),
        "push_join": lambda s: s.queue_push("kv/joins", spoof.SerializeToString()),
        "flood": lambda s: [s.set(f"flood/{i}", b"\0" * FLOOD) for i in range(64)],
        "tp_keys": lambda s: s.get("tp/0"),
    }
    got: dict[str, str] = {}

    def attack(what: str, fn) -> None:
        try:
            store = TCPStore(host, port, None, False, datetime.timedelta(seconds=3))
            fn(store)
            got[what] = "done"
        except Exception as e:  # noqa: BLE001 - refused, as it must be
            got[what] = f"refused: {type(e).__name__}"

    threads = [threading.Thread(target=attack, args=a, daemon=True) for a in attacks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return {k: got.get(k, "refused: no answer") for k in attacks}


def _raw_attacks(address: str) -> dict:
    """Sockets that speak the rendezvous without the secret: made-up proofs, each
    followed by 4 MiB (64 of them), and 80 connections that never answer the challenge.
    ``after_challenge``: bytes the rendezvous sent past its challenge (must be none)."""
    from pdserve.kv_transfer import gloo_wire as wire
    from pdserve.rendezvous.wire import CHALLENGE, HELLO

    host, port = wire.split_address(address)
    hello, after = len(HELLO) + CHALLENGE, 0
    for _ in range(64):
        with socket.create_connection((host, port), timeout=10) as s:
            with contextlib.suppress(OSError):  # closed on us while we write: refused
                s.sendall(secrets.token_bytes(48) + b"\0" * FLOOD)
            with contextlib.suppress(OSError):
                data = b""
                while chunk := s.recv(1 << 16):
                    data += chunk
                after += max(0, len(data) - hello)
    stalled = [socket.create_connection((host, port), timeout=10) for _ in range(80)]
    time.sleep(1)
    for s in stalled:
        s.close()
    return {"after_challenge": after, "stalled": len(stalled)}


def gloo(address: str, name: str, tp_address: str) -> dict:
    """The KV receiver's rendezvous and the tensor-parallel world's: what each attack
    got (every one refused, no byte past a challenge)."""
    return {
        "kv": {**_store_attacks(address, name), **_raw_attacks(address)},
        "tp": {**_store_attacks(tp_address, name), **_raw_attacks(tp_address)},
    }


def grpc_(address: str, token: str) -> dict:
    import grpc

    from pdserve.kv_transfer import kv_transfer_pb2 as pb
    from pdserve.kv_transfer.grpc_sender import CHANNEL_OPTIONS, METHOD

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

    from pdserve.kv_transfer import grpc_gate as gate
    from pdserve.kv_transfer import kv_transfer_pb2 as pb
    from pdserve.kv_transfer.grpc_sender import CHANNEL_OPTIONS, METHOD

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
    backend, address, name, token, *tp = sys.argv[1:]
    import grpc  # noqa: F401 - imported before "ready", so that the attack starts at once
    import torch  # noqa: F401

    print("ready", flush=True)
    sys.stdin.readline()
    if backend == "idle":
        out = idle(address, name)
    else:
        out = gloo(address, name, tp[0]) if backend == "gloo" else grpc_(address, token)
    print(json.dumps(out), flush=True)
