"""router/stall.py on its own: which streams in flight stall and what their error says
(tests/cluster/test_attempts.py stops real instances under a small bound)."""

from __future__ import annotations

import time

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.stall import StallWatch
from pdserve.router.stream import Delta, RequestStream


def stream(request_id: str) -> RequestStream:
    return RequestStream(request_id, [3, 4, 5], SamplingParams(max_tokens=4))


def test_only_a_placed_stream_idle_past_the_bound_stalls():
    stalled = []
    watch = StallWatch(5.0, lambda s, why: stalled.append((s.request_id, why)))
    assert watch.interval_s == 1.0
    migrated, streaming, queued = stream("migrated"), stream("streaming"), stream("queued")
    migrated.waits_for("an instance to continue on (attempt 1 ended: decode-0 failed)")
    migrated.progress_at -= 6.0  # waited past the bound
    streaming.waits_for("tokens from decode-0")
    streaming.progress_at = time.monotonic() - 1.0  # a token came a second ago
    queued.progress_at -= 60.0  # never placed: the admission queue's timeout bounds it
    watch.check({s.request_id: s for s in (migrated, streaming, queued)})
    [(request_id, why)] = stalled
    assert request_id == "migrated"
    assert why.startswith("no progress for 6")
    assert "(router.stall_timeout_s=5): waited for an instance to continue on (attempt 1" in why


def test_tokens_are_progress():
    s = stream("r")
    s.waits_for("tokens from decode-0")
    s.progress_at -= 10.0
    s.deliver(Delta([7], "x"))
    assert time.monotonic() - s.progress_at < 1.0 and s.waiting_for == "tokens from decode-0"
    assert StallWatch(0.4, lambda *a: None).interval_s == 0.1
