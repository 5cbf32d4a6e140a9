"""The other process of the KV transfer tests: prefill-side senders or decode-side
receivers, driven by JSON lines on stdin (one reply line each on stdout).

    python -m tests.kv_transfer.peer
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

from kv_transfer import Handoff, KVDestination, get_transport
from tests.kv_transfer.helpers import layout, reference, shard


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class PeerState:
    def __init__(self):
        self.senders: dict[str, list] = {}
        self.receivers = []
        self.caches = []

    def senders_(self, key: str, backend: str, tp: int, name: str, checksum: bool,
                 layers: int, device: str = "cpu", **options):  # fmt: skip
        if device != "cpu":
            torch.cuda.set_device(torch.device(device))
        for s in self.senders.pop(key, []):
            s.close()
        tr = get_transport(backend)
        self.senders[key] = [
            tr.sender(layout(tp, r, layers), checksum=checksum, name=name, **options)
            for r in range(tp)
        ]
        return {}

    def send(self, key, tid, seed, num_blocks, src_ids, dst, send_layers=None, finish=True,
             die_after_s=None, timeout=20.0, device="cpu"):  # fmt: skip
        destination = KVDestination.from_bytes(bytes.fromhex(dst))
        senders = self.senders[key]
        full = reference(senders[0].layout, num_blocks, seed)
        for s in senders:
            cache = shard(full, s.layout).to(device)
            if send_layers is None:
                s.send_all(tid, cache, src_ids, destination)
            else:
                for layer in send_layers:
                    s.send_layer(tid, layer, cache[layer, 0], cache[layer, 1], src_ids, destination)
        if die_after_s is not None:  # die without finishing, some data on the wire
            time.sleep(die_after_s)
            os._exit(3)
        if not finish:
            return {}
        handoff = Handoff(first_token=seed)
        acks = [s.finish(tid, handoff if s.layout.tp_rank == 0 else None, timeout) for s in senders]
        return {"acks": [[a.status.name for a in ack.acks] for ack in acks]}

    def receivers_(self, backend: str, tp: int, layers: int, num_blocks: int, ports=None):
        for r in self.receivers:
            r.close()
        tr = get_transport(backend)
        self.receivers, self.caches = [], []
        for rank in range(tp):
            lay = layout(tp, rank, layers)
            cache = torch.zeros(lay.cache_shape(num_blocks), dtype=lay.torch_dtype)
            kw = {"port": ports[rank]} if ports else {}
            self.receivers.append(tr.receiver(lay, cache, **kw))
            self.caches.append(cache)
        return {"addresses": [r.address for r in self.receivers]}

    def expect(self, tid, dst_ids, src_tp, layers, lease_s=30.0):
        for r in self.receivers:
            r.expect(tid, dst_ids, layout(src_tp, 0, layers), lease_s=lease_s)
        return {}

    def wait(self, tid, timeout):
        outcomes = [r.wait(tid, timeout=timeout) for r in self.receivers]
        return {"bytes": [o.bytes for o in outcomes]}

    def digest(self, rank, ids):
        return {"digest": tensor_digest(self.caches[rank][:, :, ids])}

    def close(self):
        for x in [s for group in self.senders.values() for s in group] + self.receivers:
            x.close()


def main() -> None:
    torch.set_num_threads(1)
    state = PeerState()
    handlers = {
        "senders": state.senders_,
        "send": state.send,
        "receivers": state.receivers_,
        "expect": state.expect,
        "wait": state.wait,
        "digest": state.digest,
    }
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            state.close()
            print(json.dumps({"ok": True}), flush=True)
            return
        try:
            reply = {"ok": True, **handlers[op](**cmd)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
