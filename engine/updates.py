"""What an engine instance reports to its consumer (the router, a benchmark) about one
request: new tokens, its end, or a failure the router may retry elsewhere.

Updates travel back through Ray (``EngineWorker.poll``), batched per engine step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Update:
    """``request_id`` is the id the instance was given: in disaggregated mode, one per
    attempt (``<request id>#<attempt>``, the KV transfer id), so that updates of an
    abandoned attempt can never be taken for the retry's."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop, length, abort: the request ended here
    error: str | None = None  # the instance failed the request
    # The error is a failed KV handoff (transfer cut, lease expired, peer gone): the
    # request may be redone on another prefill/decode pair.
    retryable: bool = False
    handed_off: bool = False  # prefill: the request's KV reached its decode instance
    # phase times (wall clock, seconds), KV bytes moved, transfer seconds
    info: dict = field(default_factory=dict)

    @property
    def final(self) -> bool:
        """The request is gone from the instance after this update."""
        return self.finish_reason is not None or self.error is not None or self.handed_off
