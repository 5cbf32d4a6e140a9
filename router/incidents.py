"""What a client is told when something inside the router goes wrong: one line, never a
traceback.

Invariants of both front ends: the text of an exception a client did not cause never
reaches it, and every 5xx / INTERNAL a client gets names an incident id. An unexpected
exception is logged with its traceback under a new incident id (``internal_error``);
an instance's failure (``Delta.error``) reaches the client as its first line and an
incident id, the whole logged under it (``one_line``). The id is what an operator greps
the router's log for.
"""

from __future__ import annotations

import logging
import uuid

log = logging.getLogger(__name__)


def _incident() -> str:
    return uuid.uuid4().hex[:12]


def internal_error(where: str) -> str:
    """Log the exception being handled, with its traceback, under a new incident id
    (call from an ``except`` block); the one line its client gets."""
    incident = _incident()
    log.exception("%s: internal error (incident %s)", where, incident)
    return f"internal error in the router (incident {incident}; the router's log has the details)"


def first_line(error: BaseException) -> str:
    """An exception's first line (a Ray error's names what happened; the rest is a
    remote traceback); its type's name when it has no text."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def one_line(error: str) -> str:
    """An instance's failure as its client sees it: the first line of ``error`` (a
    worker's text may go on with a traceback) naming an incident id; the whole is
    logged under that id."""
    first = error.strip().partition("\n")[0]
    incident = _incident()
    log.error("request failed (incident %s): %s", incident, error)
    return f"{first} (incident {incident}; the router's log has the details)"
