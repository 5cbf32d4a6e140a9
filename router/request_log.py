"""Log lines a person can follow (docs/serving.md, "Metrics and logs"): the process's
log format and level (the config's ``logging`` section), and the one line the router
writes per request when its front end lets it go.

``configure(format, level)`` sets the root logger of the process it runs in (the
router actor, the ``pdserve`` CLI): ``text`` is ``time level logger: message``;
``json`` is one JSON object a line with ``time`` (ISO 8601, UTC), ``level``,
``logger`` and ``message``, plus the fields a record carries in ``extra={"fields":
{...}}`` (the request line's). The request line, at INFO on the logger
``router.requests``: ``request <id> <outcome>`` and its fields as ``key=value`` in
text; in JSON the same fields as keys (``REQUEST_FIELDS``).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from pdserve.router.stream import RequestStream

FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
REQUEST_FIELDS = (
    "request_id",
    "outcome",
    "instances",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "queue_ms",
    "kv_bytes",
    "transfer_ms",
    "attempts",
    "prefill",
    "failures",
)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

requests_log = logging.getLogger("router.requests")


class JsonFormatter(logging.Formatter):
    """One JSON object per record (an exception's traceback under ``exc_info``)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure(format: str = "text", level: str = "INFO") -> None:
    """Log records of ``level`` and above to stderr in ``format`` (replacing the root
    logger's handlers). Raises ValueError naming the key for a format or level not in
    ``FORMATS`` / ``LEVELS``."""
    if format not in FORMATS:
        raise ValueError(f"logging.format={format!r}: allowed values are {', '.join(FORMATS)}")
    if level not in LEVELS:
        raise ValueError(f"logging.level={level!r}: allowed values are {', '.join(LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def request_fields(stream: RequestStream, outcome: str) -> dict:
    """The request line's fields (``REQUEST_FIELDS``), times in ms on the router's clock."""
    t = stream.timings()
    return {
        "request_id": stream.request_id,
        "outcome": outcome,
        "instances": t.instances,
        "prompt_tokens": len(stream.prompt_ids),
        "cached_tokens": stream.usage().cached_tokens,
        "output_tokens": stream.num_tokens,
        "ttft_ms": t.ttft_ms,
        "tpot_ms": t.tpot_ms,
        "e2e_ms": t.e2e_ms,
        "queue_ms": t.queue_ms,
        "kv_bytes": t.kv_bytes,
        "transfer_ms": t.transfer_ms,
        "attempts": t.attempts,
        # hybrid mode: each attempt's prefill choice, "where:reason" (else empty)
        "prefill": [c.label for c in stream.attempt.choices],
        # why each earlier attempt ended (attempts - 1 of them; else empty)
        "failures": list(stream.attempt.failures),
    }


def log_request(stream: RequestStream, outcome: str) -> None:
    """The request's line: ``outcome`` is how it ended (a finish reason, error, refused)."""
    if not requests_log.isEnabledFor(logging.INFO):
        return
    fields = request_fields(stream, outcome)
    shown = " ".join(
        f"{k}={('; ' if k == 'failures' else ',').join(v) if isinstance(v, list) else v}"
        for k, v in fields.items()
        if k not in ("request_id", "outcome")
    )
    requests_log.info(
        "request %s %s %s", stream.request_id, outcome, shown, extra={"fields": fields}
    )
