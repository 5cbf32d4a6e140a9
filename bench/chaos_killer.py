"""The chaos run's killer: a real signal to a real engine process, every few seconds.

Every ``every_s`` seconds (the first after ``every_s``) it picks a role (``any``: one
of the config's roles at random), a random instance of that role that the router
reports serving and that this killer has not already signalled (a victim is back in
the draw once its pid changed: restarted), and for a tensor-parallel instance a
random rank; asks that rank's Ray actor for its pid (``ready()``, bounded) and sends
``os.kill(pid, SIGKILL)`` (or SIGSTOP: a hang). Rank 0 is the actor ``<role>-<index>``,
rank r > 0 ``<role>-<index>-rank<r>``, both in the namespace ``pdserve``. One random
generator, seeded, makes every choice, so a seed replays the same choices (the
outcome still depends on timing).

Signals go to local pids: the cluster must run on this machine's embedded Ray.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

ROLES = ("prefill", "decode", "colocated", "any")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
PID_TIMEOUT_S = 5.0  # a stopped (or dying) actor does not answer ready(): skip it


@dataclass(frozen=True)
class Target:
    name: str  # the instance, <role>-<index>
    role: str
    tensor_parallel: int


@dataclass
class KillEvent:
    t: float  # seconds since the load started
    instance: str | None
    rank: int | None
    pid: int | None
    signal: str
    skipped: str | None = None  # why nothing was signalled

    def to_dict(self) -> dict:
        return asdict(self)


def targets(config) -> list[Target]:
    """Every engine instance a ``ClusterConfig`` starts."""
    return [
        Target(f"{role}-{index}", role, pool.tensor_parallel)
        for role, pool in config.pools().items()
        for index in range(pool.instances)
    ]


def actor_pid(name: str, timeout_s: float = PID_TIMEOUT_S) -> int:
    """The pid of the Ray actor ``name`` (an engine rank), from its ``ready()``."""
    import ray

    from cluster.ray_env import NAMESPACE

    actor = ray.get_actor(name, namespace=NAMESPACE)
    return ray.get(actor.ready.remote(), timeout=timeout_s)["pid"]


def check_choice(all_targets: list[Target], role: str, sig: str) -> list[str]:
    """The config's roles, once ``role`` and ``sig`` are known to fit; ValueError else."""
    roles = sorted({t.role for t in all_targets})
    if role != "any" and role not in roles:
        raise ValueError(f"--role {role}: this config has {', '.join(roles)} (or any)")
    if sig not in SIGNALS:
        raise ValueError(f"--signal {sig}: expected one of {', '.join(SIGNALS)}")
    return roles


class Killer(threading.Thread):
    def __init__(
        self,
        all_targets: list[Target],
        role: str,
        sig: str,
        every_s: float,
        seed: int,
        serving: Callable[[], set[str]],
        start: float,
        on_event: Callable[[KillEvent], None] = lambda e: None,
    ):
        """``serving()``: the instances the router last reported serving; ``start``:
        the load's start (``time.monotonic()``), the zero of every event's ``t``."""
        super().__init__(name="chaos-killer", daemon=True)
        roles = check_choice(all_targets, role, sig)
        self.targets, self.roles, self.role, self.sig = all_targets, roles, role, sig
        self.every_s, self.serving, self.start_t, self.on_event = every_s, serving, start, on_event
        self.rng = random.Random(f"{seed}-killer")
        self.events: list[KillEvent] = []
        self.signalled: dict[tuple[str, int], int] = {}  # (instance, rank) -> pid
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self._record(self.kill_one())

    def _record(self, event: KillEvent) -> None:
        self.events.append(event)
        self.on_event(event)

    def kill_one(self) -> KillEvent:
        role = self.rng.choice(self.roles) if self.role == "any" else self.role
        live = self.serving()
        pool = [t for t in self.targets if t.role == role and t.name in live]
        while pool:
            target = pool.pop(self.rng.randrange(len(pool)))
            rank = self.rng.randrange(target.tensor_parallel)
            actor = target.name if rank == 0 else f"{target.name}-rank{rank}"
            try:
                pid = actor_pid(actor)
            except Exception:  # dead, stopped or being restarted: not a live victim
                continue
            if self.signalled.get((target.name, rank)) == pid:
                continue  # signalled already and not restarted since
            now = time.monotonic() - self.start_t
            os.kill(pid, SIGNALS[self.sig])
            self.signalled[(target.name, rank)] = pid
            return KillEvent(round(now, 3), target.name, rank, pid, self.sig)
        now = round(time.monotonic() - self.start_t, 3)
        return KillEvent(now, None, None, None, self.sig, f"no live {role} instance to signal")

    def stopped_pids(self) -> list[int]:
        """Pids this killer stopped (SIGSTOP) that still exist: the caller ends them
        (SIGKILL) before shutting down, so that Ray need not wait on them."""
        if self.sig != "STOP":
            return []
        alive = []
        for pid in {e.pid for e in self.events if e.pid is not None}:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            alive.append(pid)
        return alive
