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

from pdserve.engine.block_manager import BlockManager
from pdserve.kv_transfer import Handoff, KVDestination, KVTransferError, get_transport
from tests.kv_transfer.helpers import BS, SECRET, layout, reference, shard


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class PeerState:
    def __init__(self):
        self.senders: dict[str, list] = {}
        self.receivers = []
        self.caches = []
        self.blocks: BlockManager | None = None  # this side's pool, for the handoff table
        self.outcomes: dict[str, object] = {}  # transfer id -> the receiver's Outcome

    def senders_(self, key: str, backend: str, tp: int, name: str, checksum: bool,
                 layers: int, device: str = "cpu", latent: dict | None = None,
                 dtype: str = "float32", **options):  # fmt: skip
        if device != "cpu":
            torch.cuda.set_device(torch.device(device))
        for s in self.senders.pop(key, []):
            s.close()
        tr = get_transport(backend)
        lays = [layout(tp, r, layers, dtype, latent) for r in range(tp)]
        opts = dict(secret=SECRET, checksum=checksum, name=name, **options)
        self.senders[key] = [tr.sender(lay, **opts) for lay in lays]
        return {}

    def send(self, key, tid, seed, num_blocks, src_ids, dst, send_layers=None, finish=True,
             die_after_s=None, timeout=20.0, device="cpu"):  # fmt: skip
        destination = KVDestination.from_bytes(bytes.fromhex(dst))
        senders = self.senders[key]
        full = reference(senders[0].layout, num_blocks, seed)
        try:
            for s in senders:
                cache = shard(full, s.layout).to(device)
                if send_layers is None:
                    s.send_all(tid, cache, src_ids, destination)
                else:
                    for layer in send_layers:
                        if s.layout.kind == "latent":
                            s.send_latent_layer(tid, layer, cache[layer], src_ids, destination)
                            continue
                        k, v = cache[layer, 0], cache[layer, 1]
                        s.send_layer(tid, layer, k, v, src_ids, destination)
        except KVTransferError:  # as a prefill instance does: no END from any rank
            for s in senders:
                s.abort(tid)
            raise
        if die_after_s is not None:  # die without finishing, some data on the wire
            time.sleep(die_after_s)
            os._exit(3)
        if not finish:
            return {}
        handoff = Handoff(first_token=seed)
        acks = [s.finish(tid, handoff if s.layout.tp_rank == 0 else None, timeout) for s in senders]
        return {"acks": [[a.status.name for a in ack.acks] for ack in acks],
                "bytes": [ack.bytes for ack in acks]}  # fmt: skip

    # -- the handoff table (tests/kv_transfer/test_handoff.py): each side's block pool --
    def pool(self, num_blocks: int):
        self.blocks = BlockManager(num_blocks, BS)
        return {}

    def handoff(self, key, tid, seed, count, dst, timeout):
        """Prefill side: blocks held for the transfer, its layers sent one by one, each
        rank's END (rank 0's with the handoff) and answers; the blocks freed whatever
        happened (as a prefill instance does once ``finish`` returned or raised)."""
        src_ids = self.blocks.allocate(tid, count * BS)
        try:
            return self.send(key, tid, seed, self.blocks.num_blocks, src_ids, dst,
                             send_layers=[0, 1, 2], timeout=timeout)  # fmt: skip
        finally:
            self.blocks.free(tid)

    def reserve(self, tid, count, src_tp, lease_s):
        """Decode side: blocks held and expected by rank 0's receiver."""
        ids = self.blocks.allocate(tid, count * BS)
        receiver = self.receivers[0]
        receiver.on_event = lambda o: self.outcomes.__setitem__(o.transfer_id, o)
        src = layout(src_tp, 0, receiver.layout.num_layers)
        token = receiver.expect(tid, ids, src, lease_s=lease_s)
        dst = KVDestination([receiver.address], ids, receiver.layout, receiver.backend, token)
        return {"dst": dst.to_bytes().hex(), "ids": ids}

    def outcome(self, tid, timeout):
        """The transfer's end as its owner hears it (None while it runs, or once gone)."""
        deadline = time.monotonic() + timeout
        while tid not in self.outcomes and time.monotonic() < deadline:
            if self.receivers[0].state(tid) is None:
                return {"state": "released"}
            time.sleep(0.01)
        o = self.outcomes.get(tid)
        if o is None:
            state = self.receivers[0].state(tid)
            return {"state": None if state is None else state.value}
        error = None if o.error is None else f"{type(o.error).__name__}: {o.error}"
        landed = o.handoff.first_token if o.handoff is not None else None
        return {"state": o.state.value, "error": error, "first_token": landed}

    def release(self, tid):
        """As the owner: out of the receiver, blocks freed and zeroed (a byte landing in
        them after this shows)."""
        self.receivers[0].release(tid)
        ids = self.blocks.block_table(tid)
        self.blocks.free(tid)
        self.caches[0][:, :, ids] = 0
        return {}

    def zeroed(self, ids):
        return {"zeroed": not self.caches[0][:, :, ids].any()}

    def landed_equal(self, ids, seed, src_ids):
        want = reference(self.receivers[0].layout, self.blocks.num_blocks, seed)[:, :, src_ids]
        return {"equal": tensor_digest(self.caches[0][:, :, ids]) == tensor_digest(want)}

    def integrity(self):
        self.blocks.check_integrity()
        return {"free": self.blocks.num_free_blocks, "total": self.blocks.num_blocks}

    def receivers_(self, backend: str, tp: int, layers: int, num_blocks: int, ports=None):
        for r in self.receivers:
            r.close()
        tr = get_transport(backend)
        self.receivers, self.caches = [], []
        for rank in range(tp):
            lay = layout(tp, rank, layers)
            cache = torch.zeros(lay.cache_shape(num_blocks), dtype=lay.torch_dtype)
            kw = {"port": ports[rank]} if ports else {}
            self.receivers.append(tr.receiver(lay, cache, secret=SECRET, **kw))
            self.caches.append(cache)
        return {"addresses": [r.address for r in self.receivers]}

    def expect(self, tid, dst_ids, src_tp, layers, lease_s=30.0):
        for r in self.receivers:
            r.expect(tid, dst_ids, layout(src_tp, 0, layers), lease_s=lease_s, token=tid)
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
        "pool": state.pool,
        "handoff": state.handoff,
        "reserve": state.reserve,
        "outcome": state.outcome,
        "release": state.release,
        "zeroed": state.zeroed,
        "landed_equal": state.landed_equal,
        "integrity": state.integrity,
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
