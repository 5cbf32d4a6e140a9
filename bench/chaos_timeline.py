"""The chaos run's timeline: the router's view sampled every ~0.5 s, and the time each
kill took to recover from.

A sample is the router's ``stats()`` (bounded: a router that does not answer in time
gives a sample with ``error`` and no figures) reduced to the requests in flight and
each instance's ``state`` (starting, serving, failed, restarting) and ``restarts``.

Recovery of a kill at ``t``: the first sample after ``t`` where every instance is
serving again, counted only once the victim was seen leaving the serving state (or its
``restarts`` went up): a sample taken before the router noticed the kill shows every
instance serving too, and must not pass for a recovery. A victim the router never saw
leave is ``not detected``; one that left and did not come back by the end of the
run, ``not recovered``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

from router.incidents import first_line

STATS_TIMEOUT_S = 2.0


def one_line(e: BaseException) -> str:
    """An exception as its type and first line (Ray's errors run over many lines)."""
    return f"{type(e).__name__}: {first_line(e)}"[:200]


@dataclass
class Sample:
    t: float  # seconds since the load started
    in_flight: int | None = None
    queued: int | None = None
    states: dict[str, str] = field(default_factory=dict)  # instance -> state
    restarts: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    @property
    def live(self) -> int | None:
        if self.error is not None:
            return None
        return sum(s == "serving" for s in self.states.values())

    def to_dict(self) -> dict:
        return {**asdict(self), "live": self.live}


def sample(router, t: float) -> Sample:
    """One sample of the router (a Ray actor handle) at ``t``."""
    import ray

    try:
        stats = ray.get(router.stats.remote(), timeout=STATS_TIMEOUT_S)
    except Exception as e:  # a sample the plot shows as a gap
        return Sample(t, error=one_line(e))
    per = stats["instances"]
    return Sample(
        t,
        stats["in_flight"],
        stats["queued"],
        {s["name"]: s["state"] for s in per},
        {s["name"]: s["restarts"] for s in per},
    )


class Sampler(threading.Thread):
    def __init__(self, router, start: float, interval_s: float = 0.5):
        super().__init__(name="chaos-sampler", daemon=True)
        self.router, self.start_t, self.interval_s = router, start, interval_s
        self.samples: list[Sample] = []
        self._halt = threading.Event()

    def latest(self) -> Sample | None:
        """The router's last answer (older than the last sample when that one failed)."""
        return next((s for s in reversed(self.samples) if s.error is None), None)

    def answering(self) -> bool:
        return bool(self.samples) and self.samples[-1].error is None

    def serving(self) -> set[str]:
        """The instances serving in the router's last answer."""
        last = self.latest()
        return set() if last is None else {n for n, s in last.states.items() if s == "serving"}

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def run(self) -> None:
        while True:
            self.samples.append(sample(self.router, round(time.monotonic() - self.start_t, 3)))
            if self._halt.wait(self.interval_s):
                return


def recovery(kill_t: float, victim: str, samples: list[Sample]) -> dict:
    """How the cluster came back from a kill of ``victim`` at ``kill_t``: ``status`` in
    {"recovered", "not recovered", "not detected"}, ``seconds`` (kill to every instance
    serving) when recovered, ``down_at`` (first sample without the victim serving)."""
    ok = [s for s in samples if s.error is None]
    before = [s for s in ok if s.t <= kill_t]
    restarts0 = before[-1].restarts.get(victim, 0) if before else 0
    down_at = None
    for s in (s for s in ok if s.t > kill_t):
        left = s.states.get(victim) != "serving" or s.restarts.get(victim, 0) > restarts0
        if down_at is None and left:
            down_at = s.t
        if down_at is not None and all(v == "serving" for v in s.states.values()):
            return {"status": "recovered", "seconds": round(s.t - kill_t, 2), "down_at": down_at}
    status = "not detected" if down_at is None else "not recovered"
    return {"status": status, "seconds": None, "down_at": down_at}
