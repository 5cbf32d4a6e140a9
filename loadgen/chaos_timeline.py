"""The chaos run's timeline: the router's view sampled every ~0.5 s, and the time each
kill took to recover from.

A sample is the router's ``stats()`` (bounded: a router that does not answer in time
gives a sample with ``error`` and no figures) reduced to the requests in flight and
each instance's ``state`` (starting, serving, failed, restarting) and ``restarts``; and
the pid each control actor (the supervisor's ``ping()``, each router replica's
``pid()``, found by name) answered within the same bound, None when it did not.

Recovery of an instance's kill at ``t``: the first sample after ``t`` where every instance is
serving again, counted only once the victim was seen leaving the serving state (or its
``restarts`` went up): a sample taken before the router noticed the kill shows every
instance serving too, and must not pass for a recovery. A victim the router never saw
leave is ``not detected``; one that left and did not come back by the end of the
run, ``not recovered``. Recovery of a control actor's kill (its pid ``p``): the first
sample after ``t`` where it answers from a pid other than ``p`` (a new process); ``not
detected`` when every sample after ``t`` still had ``p`` answer, ``not recovered`` when
it stopped answering and no new pid answered by the end of the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

from pdserve.router.incidents import first_line

STATS_TIMEOUT_S = 2.0  # the router's stats and every control actor's pid, together


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
    error: str | None = None  # the router's stats did not come
    pids: dict[str, int | None] = field(default_factory=dict)  # control actor -> pid

    @property
    def live(self) -> int | None:
        if self.error is not None:
            return None
        return sum(s == "serving" for s in self.states.values())

    def to_dict(self) -> dict:
        return {**asdict(self), "live": self.live}


def _pid_call(name: str):
    """The call that answers ``name``'s pid: the supervisor's ``ping``, a router's ``pid``."""
    import ray

    from pdserve.cluster.ray_env import NAMESPACE

    actor = ray.get_actor(name, namespace=NAMESPACE)
    return actor.ping.remote() if name == "supervisor" else actor.pid.remote()


def _answer(ref, deadline: float):
    """``ref``'s value by ``deadline`` (``time.monotonic()``); raises what Ray raised."""
    import ray

    return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))


def sample(router, t: float, control: tuple[str, ...] = ()) -> Sample:
    """One sample at ``t`` of the router (a Ray actor handle) and of the ``control``
    actors' pids (by name), all asked at once and bounded together."""
    deadline = time.monotonic() + STATS_TIMEOUT_S
    calls = {}
    for name in control:
        try:
            calls[name] = _pid_call(name)
        except Exception:  # not found: gone for good
            calls[name] = None
    pids: dict[str, int | None] = {}
    for name, ref in calls.items():
        try:
            answer = None if ref is None else _answer(ref, deadline)
        except Exception:  # dead, restarting or stopped: no pid this time
            answer = None
        pids[name] = answer["pid"] if isinstance(answer, dict) else answer
    try:
        stats = _answer(router.stats.remote(), deadline)
    except Exception as e:  # a sample the plot shows as a gap
        return Sample(t, error=one_line(e), pids=pids)
    per = stats["instances"]
    return Sample(
        t,
        stats["in_flight"],
        stats["queued"],
        {s["name"]: s["state"] for s in per},
        {s["name"]: s["restarts"] for s in per},
        pids=pids,
    )


class Sampler(threading.Thread):
    def __init__(
        self, router, start: float, control: tuple[str, ...] = (), interval_s: float = 0.5
    ):
        """``control``: the names of the control actors whose pids each sample has."""
        super().__init__(name="chaos-sampler", daemon=True)
        self.router, self.start_t, self.interval_s = router, start, interval_s
        self.control = control
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

    def answering_control(self) -> set[str]:
        """The control actors that answered the last sample's probe."""
        if not self.samples:
            return set()
        return {n for n, pid in self.samples[-1].pids.items() if pid is not None}

    def live(self) -> set[str]:
        """What the killer may signal now: ``serving()`` and ``answering_control()``."""
        return self.serving() | self.answering_control()

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def run(self) -> None:
        while True:
            t = round(time.monotonic() - self.start_t, 3)
            self.samples.append(sample(self.router, t, self.control))
            if self._halt.wait(self.interval_s):
                break
        # one more at the stop: the caller stops it once it saw the cluster settled,
        # which may be after the sample before (a recovery in between would be missed)
        t = round(time.monotonic() - self.start_t, 3)
        self.samples.append(sample(self.router, t, self.control))


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


def control_recovery(kill_t: float, victim: str, pid: int, samples: list[Sample]) -> dict:
    """How a control actor ``victim`` came back from a signal to its process ``pid`` at
    ``kill_t`` (module docstring): ``status``, ``seconds`` (to the first answer from a
    new pid), ``down_at`` (first sample where ``pid`` no longer answered)."""
    down_at = None
    for s in (s for s in samples if s.t > kill_t):
        now = s.pids.get(victim)
        if down_at is None and now != pid:
            down_at = s.t
        if now is not None and now != pid:
            return {"status": "recovered", "seconds": round(s.t - kill_t, 2), "down_at": down_at}
    status = "not detected" if down_at is None else "not recovered"
    return {"status": status, "seconds": None, "down_at": down_at}
