"""The receiving end of ``bench.kv_transfer``: a child process holding a paged cache, the
gloo and grpc receivers, a raw gloo group and a raw gRPC server, driven line by line
(JSON) over its stdin by ``Peer`` in the sending process.

    python -m pdserve.bench.kv_transfer_peer --cache-blocks N --max-bytes B   (started by Peer)
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys

import torch

LAYOUT = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
CHUNK = 1 << 20
MiB = 1 << 20


def _layout():
    from pdserve.kv_transfer import KVLayout

    return KVLayout(**LAYOUT)


def _slices(buf: torch.Tensor, parts: int) -> list[torch.Tensor]:
    step = -(-buf.numel() // parts)
    return [buf[i : i + step] for i in range(0, buf.numel(), step)]


# ---------------------------------------------------------------------------------------
# receiver process
# ---------------------------------------------------------------------------------------
def _receiver(args) -> None:
    from concurrent import futures

    import grpc
    from torch.distributed import PrefixStore

    from pdserve.kv_transfer import get_transport
    from pdserve.kv_transfer.gloo_wire import GlooGroup, listening_store

    torch.set_num_threads(1)
    layout = _layout()
    cache = torch.zeros(layout.cache_shape(args.cache_blocks))
    secret = bytes.fromhex(sys.stdin.readline().strip())  # Peer's first line: never in argv
    receivers = {
        name: get_transport(name).receiver(layout, cache, secret=secret, bind="127.0.0.1")
        for name in ("gloo", "grpc")
    }
    raw_store = listening_store("127.0.0.1", 0, datetime.timedelta(seconds=60))
    raw_dst = torch.empty(args.max_bytes, dtype=torch.uint8)

    def push(chunks, context):
        off = 0
        for chunk in chunks:
            n = len(chunk)
            raw_dst[off : off + n].copy_(torch.frombuffer(chunk, dtype=torch.uint8))
            off += n
        return off.to_bytes(8, "little")

    import warnings

    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_receive_message_length", 64 * MiB)],
    )
    handler = grpc.method_handlers_generic_handler(
        "bench.Raw", {"Push": grpc.stream_unary_rpc_method_handler(push)}
    )
    server.add_generic_rpc_handlers((handler,))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out = {name: r.address for name, r in receivers.items()}
    out.update(raw_gloo=raw_store.port, raw_grpc=f"127.0.0.1:{grpc_port}")
    print(json.dumps(out), flush=True)
    raw_pg = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        reply: dict = {"ok": True}
        if op == "expect":
            receiver = receivers[cmd["backend"]]
            reply["token"] = receiver.expect(cmd["tid"], cmd["dst"], layout, lease_s=120)
        elif op == "wait":
            st = receivers[cmd["backend"]].wait(cmd["tid"], timeout=120)
            reply["bytes"] = st.bytes
        elif op == "raw_gloo":
            print(json.dumps(reply), flush=True)  # ready: the group (once) and recvs follow
            if raw_pg is None:
                raw_pg = GlooGroup.make_group(
                    PrefixStore("raw", raw_store), 1, "127.0.0.1", datetime.timedelta(seconds=60)
                )
            ack = torch.zeros(1, dtype=torch.int64)
            bufs = _slices(raw_dst[: cmd["nbytes"]], cmd["parts"])
            for work in [raw_pg.recv([b], 0, 0) for b in bufs]:  # all posted at once
                work.wait()
            raw_pg.send([ack], 0, 1).wait()
            continue
        elif op == "quit":
            break
        print(json.dumps(reply), flush=True)
    for r in receivers.values():
        r.close()
    server.stop(None)


# ---------------------------------------------------------------------------------------
# sender (this process)
# ---------------------------------------------------------------------------------------
class Peer:
    def __init__(self, cache_blocks: int, max_bytes: int, secret: bytes):
        """The receiving process; ``secret``: the KV plane's, sent as its first line."""
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.bench.kv_transfer_peer",
                "--cache-blocks",
                str(cache_blocks),
                "--max-bytes",
                str(max_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.proc.stdin.write(secret.hex() + "\n")
        self.proc.stdin.flush()
        self.addresses = json.loads(self.proc.stdout.readline())

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if not reply.get("ok"):
            raise RuntimeError(f"receiver: {reply}")
        return reply

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            self.proc.kill()


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="pdserve.bench.kv_transfer_peer")
    p.add_argument("--cache-blocks", type=int, required=True)
    p.add_argument("--max-bytes", type=int, required=True)
    _receiver(p.parse_args())
