"""A fault-injecting KV transport for the tests: the real gloo or grpc backend, with the
faults a plan names injected at the steps every backend goes through
(kv_transfer/sender.py: ``_post``, ``_end``, ``_sum``; kv_transfer/receiver.py:
``claim``, ``end``). Nothing of it is in the production path.

A cluster takes it by name (``kv_transfer.backend: tests.kv_transfer.faults:gloo``);
the plan is a JSON list of rules in the file ``$PDSERVE_KV_FAULTS`` names, read at
every step, so a test changes it while a cluster runs. A rule:

    side    "sender" | "receiver"
    step    "data" (a sender's segments for one decode rank / a receiver's claim),
            "end" (a sender's END / a receiver's END from a source),
            "ack" (a sender about to wait for its ENDs' answers)
    action  drop | delay | duplicate | corrupt | cut | disconnect | kill | abort
    match   a substring of the transfer id ("" matches all)
    nth     the occurrence of the step within the transfer (1-based; 0: every one)
    rank    the rank of the process's sender or receiver (-1: any)
    seconds how long ``delay`` sleeps
    pause_s how long to wait before acting (a ``kill`` after what was posted went out)

``corrupt`` makes the segment's checksum lie (the receiver sees bytes that differ from
what was summed); ``cut`` drops this message and every later one of the transfer (the
link went down); ``disconnect`` closes the connection; ``kill`` sends SIGKILL to the
process itself; ``abort`` (receiver) releases the transfer on another thread, as its
owner would on a cancel, racing the write or the END that goes on meanwhile, and zeroes
its blocks once released (so any byte that lands afterwards shows).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import defaultdict

from pdserve.kv_transfer import Transport
from pdserve.kv_transfer.gloo_receiver import GlooReceiver
from pdserve.kv_transfer.gloo_sender import GlooSender
from pdserve.kv_transfer.grpc_receiver import GrpcReceiver
from pdserve.kv_transfer.grpc_sender import GrpcSender
from pdserve.kv_transfer.protocol import KVTransferError, KVTransferTimeout, Status

ENV = "PDSERVE_KV_FAULTS"


def write_plan(path, rules: list[dict]) -> None:
    """Replace the plan at ``path`` (atomically: readers see the old or the new one)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(rules, f)
    os.replace(tmp, path)


class Faults:
    """The rules that apply to one side of one process, and its per-transfer counters."""

    def __init__(self, side: str):
        self.side = side
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        self.cut: set[str] = set()
        self.lock = threading.Lock()

    def take(self, step: str, transfer_id: str, rank: int) -> dict | None:
        """The rule hitting this occurrence of ``step`` (None: carry on)."""
        path = os.environ.get(ENV)
        try:
            with open(path) as f:
                rules = json.load(f)
        except (TypeError, OSError, ValueError):
            rules = []
        with self.lock:
            self.counts[transfer_id, step] += 1
            n = self.counts[transfer_id, step]
            if transfer_id in self.cut:
                return {"action": "drop"}
        for rule in rules:
            if (
                rule.get("side") == self.side
                and rule.get("step") == step
                and rule.get("match", "") in transfer_id
                and rule.get("nth", 1) in (0, n)
                and rule.get("rank", -1) in (-1, rank)
            ):
                time.sleep(rule.get("pause_s", 0))
                if rule["action"] == "cut":
                    self.cut.add(transfer_id)
                    return {"action": "drop"}
                if rule["action"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                return rule
        return None


class FaultySender:
    """Mixed in before a real sender: faults at ``_post``, ``_end`` and ``_sum``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = Faults("sender")
        self._lying: set[str] = set()
        self._silent: set[str] = set()  # transfers whose END this sender dropped

    def _act(self, step, t, address, go) -> None:
        rule = self.faults.take(step, t.transfer_id, self.layout.tp_rank)
        action = None if rule is None else rule["action"]
        if action == "delay":
            time.sleep(rule["seconds"])
        elif action == "corrupt":
            self._lying.add(t.transfer_id)
        elif action == "disconnect":
            self._disconnect(address)
        elif action == "drop" and step == "end":
            self._silent.add(t.transfer_id)
        if action != "drop":
            go()
        if action == "duplicate":
            go()

    def _post(self, t, route, address, source, segments):
        self._act("data", t, address, lambda: super(FaultySender, self)._post(
            t, route, address, source, segments))  # fmt: skip

    def _end(self, t, address, handoff):
        self._act("end", t, address, lambda: super(FaultySender, self)._end(t, address, handoff))

    def _acks(self, t, timeout):
        self._act("ack", t, None, lambda: None)
        started = time.monotonic()
        try:
            return super()._acks(t, timeout)
        except KVTransferTimeout:
            raise
        except KVTransferError:
            if t.transfer_id not in self._silent:
                raise
            # over a real link the END would have gone out and no answer come back
            time.sleep(max(0.0, timeout - (time.monotonic() - started)))
            why = f"no acknowledgement within {timeout}s (END dropped, injected)"
            raise KVTransferTimeout(f"KV transfer {t.transfer_id!r}: {why}") from None

    def _sum(self, t, seg, *parts):
        total = super()._sum(t, seg, *parts)
        if t.transfer_id in self._lying:
            self._lying.discard(t.transfer_id)
            return (total + 1) & ((1 << 64) - 1)
        return total


class FaultyReceiver:
    """Mixed in before a real receiver: faults at ``claim`` and ``end``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = Faults("receiver")

    def _rule(self, step: str, key: int) -> dict | None:
        with self._cond:
            t = self._by_key.get(key)
        tid = t.transfer_id if t is not None else f"key {key:#x}"
        rule = self.faults.take(step, tid, self.layout.tp_rank)
        if rule is not None and rule["action"] == "delay":
            time.sleep(rule["seconds"])
        if rule is not None and rule["action"] == "abort" and t is not None:
            threading.Thread(target=self._abort_transfer, args=(t,), daemon=True).start()
        return rule

    def _abort_transfer(self, t) -> None:
        self.release(t.transfer_id)
        self.kv_cache[:, :, list(t.dst_block_ids)] = 0

    def claim(self, key, src_rank, src_layout, segs, link=None, on_stuck=None):
        rule = self._rule("data", key)
        if rule is not None and rule["action"] == "drop":
            return None, Status.UNKNOWN, "dropped (injected)"
        return super().claim(key, src_rank, src_layout, segs, link, on_stuck)

    def end(self, key, src_rank, handoff, link=None):
        rule = self._rule("end", key)
        if rule is not None and rule["action"] == "drop":
            return Status.UNKNOWN, "END dropped (injected)"
        return super().end(key, src_rank, handoff, link)


class FaultyGlooSender(FaultySender, GlooSender):
    pass


class FaultyGrpcSender(FaultySender, GrpcSender):
    pass


class FaultyGlooReceiver(FaultyReceiver, GlooReceiver):
    pass


class FaultyGrpcReceiver(FaultyReceiver, GrpcReceiver):
    pass


gloo = Transport("gloo", FaultyGlooSender, FaultyGlooReceiver)
grpc = Transport("grpc", FaultyGrpcSender, FaultyGrpcReceiver)
