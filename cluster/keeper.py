"""A keeper: a thread of the process that launched the cluster (``pdserve up``, or any
driver of ``cluster.launch``) that keeps one control-plane actor alive: the supervisor,
and each router replica (``revive`` starts a restarted router's servers again, on the
ports it had: cluster/launcher.py).

The supervisor actor is started with ``max_restarts=-1``: when its process dies
(SIGKILL, OOM, a crash) Ray starts it again at once, with the same handle (the router's
and the launcher's stay valid), and the new incarnation adopts the running instances
(cluster/supervised.py). A hung one (SIGSTOP, a deadlock) Ray never notices: the keeper
pings it each ``supervisor.heartbeat_s``, and a ping unanswered within
``supervisor.unresponsive_s`` kills its process (SIGKILL, by a task on its node), so
that Ray restarts it. The same two limits as the supervisor's probes of the instances
(for a router replica: ``router.heartbeat_s`` and ``router.unresponsive_s``). An actor
whose answer says ``"started": False`` is a new incarnation that Ray restarted: the
keeper calls ``revive`` (when given) to start it.

Invariant: the keeper only kills a process that answered a ping before (its ``pid``
and ``node``), so an incarnation still starting is never killed for being slow to
answer, and a pid that no longer exists is a no-op. The price: an incarnation that
hangs before its first answer is not replaced (its ``__init__`` only reads the config;
adopting runs on a thread of its own).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


def _kill_process(pid: int) -> None:
    """On the supervisor's node: SIGKILL ``pid`` (gone already: nothing to do)."""
    import contextlib
    import os
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


class Limits(Protocol):
    """``SupervisorConfig`` or ``RouterConfig``: how often to ping, when one is hung."""

    heartbeat_s: float
    unresponsive_s: float


class Keeper:
    """Pings ``actor`` (an actor handle with a ``ping`` method answering ``pid``,
    ``node`` and optionally ``started``) until ``stop``; ``what`` names it in the log;
    see the module docstring."""

    def __init__(
        self,
        actor,
        limits: Limits,
        what: str = "supervisor",
        revive: Callable[[], None] | None = None,
    ):
        self.actor, self.limits, self.what, self.revive = actor, limits, what, revive
        self.seen: dict | None = None  # the last answer: the live incarnation's pid, node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"keeper-{what}", daemon=True)

    def start(self) -> None:
        """Probe once now (the actor has just answered the launcher: this learns its
        process), then each ``heartbeat_s`` on a thread."""
        self._probe()
        self._thread.start()

    def stop(self) -> None:
        """Stop probing (before the actor is stopped on purpose)."""
        self._stop.set()
        self._thread.join(timeout=self.limits.unresponsive_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.limits.heartbeat_s):
            self._probe()

    def _probe(self) -> None:
        import ray

        try:
            answer = ray.get(self.actor.ping.remote(), timeout=self.limits.unresponsive_s)
        except ray.exceptions.GetTimeoutError:
            if self.seen is not None and not self._stop.is_set():
                self._kill_hung(self.seen)
            self.seen = None
            return
        except ray.exceptions.RayError as e:  # died under the ping, or restarting
            if self.seen is not None:
                log.warning("%s (pid %d) gone: %s", self.what, self.seen["pid"], e)
            self.seen = None
            return
        if self.seen is None:
            log.info("%s answers (pid %d)", self.what, answer["pid"])
        self.seen = answer
        if self.revive is not None and not answer.get("started", True) and not self._stop.is_set():
            log.warning("%s (pid %d) was restarted: starting it", self.what, answer["pid"])
            try:
                self.revive()
            except ray.exceptions.RayError as e:  # died again: the next probes see it
                log.warning("%s (pid %d) did not start: %s", self.what, answer["pid"], e)

    def _kill_hung(self, seen: dict) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        log.error(
            "%s (pid %d) is hung: no answer to a ping in %g s "
            "(unresponsive_s); killing it for Ray to restart it",
            self.what,
            seen["pid"],
            self.limits.unresponsive_s,
        )
        on_node = NodeAffinitySchedulingStrategy(seen["node"], soft=False)
        kill = ray.remote(_kill_process).options(num_cpus=0, scheduling_strategy=on_node)
        try:
            ray.get(kill.remote(seen["pid"]), timeout=60)
        except ray.exceptions.RayError as e:  # its node is gone: so is the process
            log.warning("could not kill the hung %s (pid %d): %s", self.what, seen["pid"], e)
