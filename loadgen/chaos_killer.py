"""The chaos run's killer: a real signal to a real process of the cluster, every few
seconds.

Targets: every engine instance ``<role>-<index>`` (roles prefill, decode, colocated;
rank 0 is that actor, rank r > 0 ``<role>-<index>-rank<r>``), the supervisor (actor
``supervisor``) and every router replica (``router``, ``router-1``, ...), all named Ray
actors in the namespace ``pdserve``. ``--role`` names one role or several
(comma-separated); ``any`` is every role the config has, the supervisor and the router
included.

Every ``every_s`` seconds (the first after ``every_s``) it takes the next role of a
round (each round is the chosen roles in a seeded random order, so n rounds signal
every role n times), a random live target of that role that this killer has not
already signalled (a victim is back in the draw once its pid changed: restarted), and
for a tensor-parallel instance a random rank; asks that actor for its pid (bounded:
``ready()`` of an engine rank, ``ping()`` of the supervisor, ``pid()`` of a router)
and sends ``os.kill(pid, SIGKILL)`` (or SIGSTOP: a hang). A role with no live target
is logged as skipped and comes first again at the next tick. Live: an instance the
router last reported serving, a control actor that answered the sampler's last probe
(loadgen/chaos_timeline.py). One seeded generator makes every choice, so a seed replays
the same choices (the outcome still depends on timing).

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

INSTANCE_ROLES = ("prefill", "decode", "colocated")
CONTROL_ROLES = ("supervisor", "router")
ROLES = (*INSTANCE_ROLES, *CONTROL_ROLES, "any")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
PID_TIMEOUT_S = 5.0  # a stopped (or dying) actor does not answer: skip it


@dataclass(frozen=True)
class Target:
    name: str  # the actor: <role>-<index>, supervisor, router, router-<k>
    role: str
    tensor_parallel: int = 1

    @property
    def instance(self) -> bool:
        return self.role in INSTANCE_ROLES


@dataclass
class KillEvent:
    t: float  # seconds since the load started
    role: str
    target: str | None
    rank: int | None
    pid: int | None
    signal: str
    skipped: str | None = None  # why nothing was signalled

    def to_dict(self) -> dict:
        return asdict(self)


def targets(config) -> list[Target]:
    """Every engine instance a ``ClusterConfig`` starts, the supervisor and every
    router replica."""
    from pdserve.router.replicas import replica_name

    instances = [
        Target(f"{role}-{index}", role, pool.tensor_parallel)
        for role, pool in config.pools().items()
        for index in range(pool.instances)
    ]
    routers = [Target(replica_name(k), "router") for k in range(config.router.replicas)]
    return [*instances, Target("supervisor", "supervisor"), *routers]


def parse_roles(text: str) -> tuple[str, ...]:
    """``--role``: one role or several, comma-separated, each one of ``ROLES``."""
    roles = tuple(dict.fromkeys(r.strip() for r in text.split(",")))
    for r in roles:
        if r not in ROLES:
            raise ValueError(f"--role {text}: {r!r} is not one of {', '.join(ROLES)}")
    return roles


def actor_pid(target: Target, rank: int = 0, timeout_s: float = PID_TIMEOUT_S) -> int:
    """The pid of ``target``'s process (of ``rank`` for an instance), from its actor."""
    import ray

    from pdserve.cluster.ray_env import NAMESPACE

    if target.role == "supervisor":
        actor = ray.get_actor(target.name, namespace=NAMESPACE)
        return ray.get(actor.ping.remote(), timeout=timeout_s)["pid"]
    if target.role == "router":
        actor = ray.get_actor(target.name, namespace=NAMESPACE)
        return ray.get(actor.pid.remote(), timeout=timeout_s)
    name = target.name if rank == 0 else f"{target.name}-rank{rank}"
    actor = ray.get_actor(name, namespace=NAMESPACE)
    return ray.get(actor.ready.remote(), timeout=timeout_s)["pid"]


def check_choice(all_targets: list[Target], roles: tuple[str, ...], sig: str) -> list[str]:
    """The roles signalled (``any`` expanded to every role of ``all_targets``), once they
    and ``sig`` are known to fit; ValueError else."""
    have = list(dict.fromkeys(t.role for t in all_targets))
    for role in roles:
        if role != "any" and role not in have:
            raise ValueError(f"--role {role}: this config has {', '.join(have)} (or any)")
    if sig not in SIGNALS:
        raise ValueError(f"--signal {sig}: expected one of {', '.join(SIGNALS)}")
    return have if "any" in roles else list(roles)


class Killer(threading.Thread):
    def __init__(
        self,
        all_targets: list[Target],
        roles: tuple[str, ...],
        sig: str,
        every_s: float,
        seed: int,
        live: Callable[[], set[str]],
        start: float,
        on_event: Callable[[KillEvent], None] = lambda e: None,
    ):
        """``live()``: the targets that may be signalled now (module docstring);
        ``start``: the load's start (``time.monotonic()``), the zero of every ``t``."""
        super().__init__(name="chaos-killer", daemon=True)
        self.roles = check_choice(all_targets, roles, sig)
        self.targets, self.sig = all_targets, sig
        self.every_s, self.live, self.start_t, self.on_event = every_s, live, start, on_event
        self.rng = random.Random(f"{seed}-killer")
        self.events: list[KillEvent] = []
        self.signalled: dict[tuple[str, int], int] = {}  # (target, rank) -> pid
        self._round: list[str] = []  # the roles still to signal in this round, in order
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

    def _next_role(self) -> str:
        if not self._round:
            self._round = self.rng.sample(self.roles, len(self.roles))
        return self._round.pop(0)

    def kill_one(self) -> KillEvent:
        role = self._next_role()
        live = self.live()
        pool = [t for t in self.targets if t.role == role and t.name in live]
        while pool:
            target = pool.pop(self.rng.randrange(len(pool)))
            rank = self.rng.randrange(target.tensor_parallel)
            try:
                pid = actor_pid(target, rank)
            except Exception:  # dead, stopped or being restarted: not a live victim
                continue
            if self.signalled.get((target.name, rank)) == pid:
                continue  # signalled already and not restarted since
            now = time.monotonic() - self.start_t
            os.kill(pid, SIGNALS[self.sig])
            self.signalled[(target.name, rank)] = pid
            return KillEvent(round(now, 3), role, target.name, rank, pid, self.sig)
        self._round.insert(0, role)  # its turn again at the next tick
        now = round(time.monotonic() - self.start_t, 3)
        return KillEvent(now, role, None, None, None, self.sig, f"no live {role} to signal")

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
