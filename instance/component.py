"""What a role adds to a serving instance (instance/worker.py): a ``Component``.

One worker class serves every role; the role is the components it holds, chosen by
the cluster (cluster/actors.py): a co-located instance holds none, a prefill instance
the sending one (prefill_worker/sending.py), a decode instance the receiving one
(decode_worker/receiving.py) and, when the decode instances prefill for each other
(hybrid mode without a prefill pool), the sending one too. Components never know of
each other: they meet in the worker, which delegates to them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the host of a component, for the checker (worker.py imports this)
    from pdserve.engine.prefilled import LastChunkHook, Prefilled
    from pdserve.instance.messages import Update
    from pdserve.instance.worker import EngineWorker


class Component(ABC):
    """A role's part of an ``EngineWorker``, made by ``Component(worker, kv_config)``
    once the worker's engine is loaded and before its step loop starts.

    What it adds, each read once by the worker when it takes the component:

    - ``handlers()``: its inbox messages' types (instance/inbox.py), each with the one
      handler that applies it on the step loop and returns the updates it produced. No
      two components of a worker handle the same type.
    - ``feed_commands()``: the update feed's commands (instance/feed.py ``COMMANDS``) it
      takes, each with the function applying it (called off the loop; it posts).
    - ``calls()``: the actor calls it serves (the worker's ``prefill``, ``reserve``,
      ``rank_acked``, ``rank_landed``), each with the function that serves it; a call no
      component of the worker serves is refused naming the role.

    And, on the step loop:

    - ``owns(request_id)``: the request is this component's (a hand-off job, a
      reservation); a request no component owns is the engine's own (``add``).
    - ``abort(request_id)``: drop an owned request in whatever state it is.
    - ``fail(request_ids)``: these requests failed in a step (the engine dropped them;
      the worker reports them): forget what the component kept of them.
    - ``last_chunk()``: the step's hand-off hook (engine/prefilled.py), or None when
      nothing of this component hands off in this step; at most one component of a
      worker returns one.
    - ``prefilled(p)``: an owned hand-off request left the engine, its prompt done.

    And from any thread: ``ready()`` (facts merged into the worker's ``ready``),
    ``stats()`` (merged into its stats snapshot, under the worker's lock) and
    ``close()`` (after the step loop ended).

    Invariants: a component touches the engine only on the step loop (its handlers,
    hooks and the worker's delegations run there); from other threads it only posts
    messages (``worker.post``). It reaches the worker through the host surface only:
    ``name``, ``role``, ``engine``, ``ranks``, ``post``, ``take_early_abort``,
    ``bind_consumer``, ``owns``, ``abort_now``, ``fail``, ``answer``, ``count``.
    """

    def __init__(self, worker: EngineWorker, kv_config: dict):
        self.worker = worker

    def handlers(self) -> dict[type, Callable[[Any], list[Update]]]:
        return {}

    def feed_commands(self) -> dict[str, Callable[[Any], None]]:
        return {}

    def calls(self) -> dict[str, Callable[..., Any]]:
        return {}

    @abstractmethod
    def owns(self, request_id: str) -> bool: ...

    @abstractmethod
    def abort(self, request_id: str) -> list[Update]: ...

    @abstractmethod
    def fail(self, request_ids: list[str]) -> None: ...

    def last_chunk(self) -> LastChunkHook | None:
        return None

    def prefilled(self, p: Prefilled) -> list[Update]:
        raise NotImplementedError(
            f"{self.worker.name}: {type(self).__name__} hands off no request "
            f"({p.request.request_id!r})"
        )

    def ready(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {}

    @abstractmethod
    def close(self) -> None: ...
