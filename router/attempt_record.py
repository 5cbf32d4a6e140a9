"""A request's attempts at the router: which one is current, on which instances, why the
earlier ones ended, and what the instances reported about them (docs/serving.md,
"Supervision and migration").

``AttemptRecord`` is the placement's half of a request (the client's half, its output
queue and clock, is ``router/stream.py``'s ``RequestStream``, which holds one record).
Every field is written only by the record's own methods, each called by one owner:

- ``begin``, ``land``, ``retire``, ``report``: the placement (router/placement.py,
  router/disagg.py) as it starts an attempt, sees its KV land, ends it, and routes its
  instances' updates;
- ``chose``: the hybrid placement (router/hybrid.py), where each attempt's prompt runs;
- ``failed``: the core's migration (``RouterCore.migrate``), once per ended attempt;
- ``adopt``: a restarted router's rebuild (router/rebuild.py), an attempt found running.

Invariant: ``id`` is empty or the id of the one attempt the instances know as current
(``<request id>#<number>.<serial>``, ``instance.messages.attempt_id``); ``retire`` is
the only way back to empty, so each attempt's end is handled once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router.prefill_choice import PrefillChoice


@dataclass
class Reported:
    """What the instances reported about a request's attempts (``Update.info``), merged
    in arrival order: the prefill side's and the decode side's handoff facts. Only
    ``cached_tokens`` is per attempt (``AttemptRecord.begin`` clears it): a later
    attempt that reports no handoff keeps the earlier one's."""

    cached_tokens: int = 0  # the prompt instance's prefix cache hit (tokens)
    kv_bytes: int = 0  # KV moved from the prefill to the decode instance
    kv_cached_tokens: int = 0  # prompt tokens whose KV the decode instance held (not sent)
    transfer_s: float = 0.0
    # wall-clock times of the handoff's phases (prefill_start ... decode_start)
    phases: dict[str, float] = field(default_factory=dict)
    # speculative decoding on the instance that ended it: guessed and accepted tokens,
    # the steps that verified some
    guesses: tuple[int, int, int] = (0, 0, 0)

    def take(self, info: dict) -> None:
        """Merge one update's ``info`` (keys it does not carry keep their value)."""
        if "cached_tokens" in info:
            self.cached_tokens = int(info["cached_tokens"])
        if "kv_bytes" in info:
            self.kv_bytes = int(info["kv_bytes"])
        if "kv_cached_tokens" in info:
            self.kv_cached_tokens = int(info["kv_cached_tokens"])
        if "transfer_s" in info:
            self.transfer_s = float(info["transfer_s"])
        if "phases" in info:
            self.phases = dict(info["phases"])
        if "guesses" in info:
            guessed, accepted, steps = info["guesses"]
            self.guesses = (int(guessed), int(accepted), int(steps))


@dataclass
class AttemptRecord:
    """One request's attempts (the module docstring says who writes what)."""

    number: int = 0  # the current (or next) attempt's number: earlier attempts that ended
    id: str = ""  # the current attempt's id; "" while none is (queued, or it ended)
    pair: tuple[str, ...] = ()  # its instances: (prefill, decode) or (the one running it)
    landed: bool = False  # its decode instance streams it (its KV landed there)
    avoid: set[str] = field(default_factory=set)  # instances of a failed attempt
    failures: list[str] = field(default_factory=list)  # why each earlier attempt ended
    # hybrid mode: where each attempt's prompt was computed and why, in attempt order
    choices: list[PrefillChoice] = field(default_factory=list)
    reported: Reported = field(default_factory=Reported)

    def begin(self, attempt_id: str, pair: tuple[str, ...]) -> None:
        """Attempt ``attempt_id`` on ``pair`` is now the current one (the placement)."""
        self.id, self.pair, self.landed = attempt_id, pair, False
        self.reported.cached_tokens = 0  # each attempt reports its own hit

    def adopt(self, attempt_id: str, pair: tuple[str, ...]) -> None:
        """A running attempt a restarted router found on its instances is current again,
        its KV landed (router/rebuild.py)."""
        self.id, self.pair, self.landed = attempt_id, pair, True

    def land(self) -> bool:
        """The decode instance streams the current attempt; True the first time."""
        if self.landed:
            return False
        self.landed = True
        return True

    def retire(self, attempt_id: str) -> bool:
        """True, once, when ``attempt_id`` is the current attempt: from then on it is not
        (``id`` is empty until the next ``begin``), so whichever path reports its end
        first handles it and every later report is a no-op."""
        if not attempt_id or self.id != attempt_id:
            return False
        self.id = ""
        return True

    def failed(self, why: str) -> None:
        """The attempt ended with ``why`` and the request goes on: the next one is
        numbered one more and avoids this one's instances (``RouterCore.migrate``)."""
        self.failures.append(why)
        self.number += 1
        self.avoid.update(self.pair)

    def chose(self, choice: PrefillChoice) -> None:
        """Where the next attempt's prompt is computed (the hybrid placement)."""
        self.choices.append(choice)

    def report(self, info: dict) -> None:
        """An instance's update about the current attempt carried ``info`` (the placement)."""
        self.reported.take(info)
