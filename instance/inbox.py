"""The serving worker's inbox (instance/worker.py): each event that reaches the step loop
is one of these frozen messages, handled in one place, the handler its type names in
the worker's ``_ops`` (a component adds its own). The loop drains them before each step.

From the actor's calls: ``Call``, ``Add``, ``Abort``, ``ConsumerLeft``, and from a
departed consumer's timer ``ConsumerExpired``; the sending component's
(prefill_worker/sending.py): ``Prefill``, and ``Acked`` from its ack threads and its
other ranks; the receiving component's (decode_worker/receiving.py): ``Reserve``, and from
threads off the loop ``Expected``, ``Landed`` and ``Released``. The attempt's id is
``attempt_id`` in each (the transfer's id and the request's id are the same).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.instance.messages import Attempt, Reserved

if TYPE_CHECKING:  # the KV transfer's event, carried as is (engine imports no transport)
    from pdserve.kv_transfer import Outcome


@dataclass(frozen=True)
class Call:
    """Run ``fn(*args)`` between steps; its result (or exception) into ``future``."""

    future: Future
    fn: Callable[..., Any]
    args: tuple


@dataclass(frozen=True)
class Add:
    """Queue ``attempt`` (co-located: prefilled and decoded here)."""

    attempt: Attempt


@dataclass(frozen=True)
class Abort:
    """Drop these attempts in whatever state they are (or when they arrive)."""

    attempt_ids: tuple[str, ...]


@dataclass(frozen=True)
class ConsumerLeft:
    """``consumer``'s update feed ended (and no grace to rejoin): drop its attempts and
    its outbox."""

    consumer: str


@dataclass(frozen=True)
class ConsumerExpired:
    """The grace of ``consumer``'s departure ``token`` ran out: drop what it left, unless
    it rejoined (or left again) meanwhile."""

    consumer: str
    token: object


@dataclass(frozen=True)
class Prefill:
    """Prefill ``attempt`` and send its KV to ``attempt.destination``."""

    attempt: Attempt


@dataclass(frozen=True)
class Acked:
    """Rank ``rank``'s ENDs of the transfer were answered (``error`` None) or failed."""

    attempt_id: str
    rank: int
    nbytes: int
    seconds: float
    error: str | None


@dataclass(frozen=True)
class Reserve:
    """Reserve blocks for ``attempt``'s KV; the answer goes to ``tell``."""

    attempt: Attempt
    tell: Callable[[Reserved], None]


@dataclass(frozen=True)
class Expected:
    """Another rank's receiver answered ``expect`` for the attempt (``error``: it failed)."""

    attempt_id: str
    error: BaseException | None


@dataclass(frozen=True)
class Landed:
    """The receiver's one event: the transfer landed, failed or expired."""

    outcome: Outcome


@dataclass(frozen=True)
class Released:
    """Another rank released the transfer: its receiver writes no byte after this."""

    attempt_id: str
