"""Readers of two production request traces' formats (docs/benchmarks.md, "Production
traces"); they hold lengths and times, no prompt text.

- Azure LLM inference trace 2023 (``read_azure``): a CSV file with the header
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` and one request a line; TIMESTAMP is a
  wall-clock time ``YYYY-MM-DD HH:MM:SS[.fraction]`` (any number of fraction digits).
- Mooncake FAST'25 traces (``read_mooncake``): JSONL, one object a line with
  ``timestamp`` (milliseconds from the trace's start), ``input_length``,
  ``output_length`` and ``hash_ids``: one id per ``MOONCAKE_BLOCK_TOKENS``-token block
  of the prompt (the last block may be partial), so ``len(hash_ids) ==
  ceil(input_length / MOONCAKE_BLOCK_TOKENS)``; two prompts whose ``hash_ids`` share a
  leading run share those blocks' tokens.

Both return ``TraceRow`` s sorted by arrival (stable), times in seconds after the
trace's first request. A row that breaks the format raises ``TraceFormatError`` naming
the file, the line, the field, its value and what is allowed; an empty trace raises too.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceFormatError(ValueError):
    """A trace file that breaks its format; the message names where and how."""


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace. Invariants: ``arrival_s >= 0``, ``prompt_len >= 1``,
    ``output_len >= 1``; ``hash_ids`` empty (Azure) or one id per
    ``MOONCAKE_BLOCK_TOKENS``-token block of the prompt (Mooncake)."""

    arrival_s: float  # seconds after the trace's first request
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def _count(where: str, field: str, value) -> int:
    """A token count >= 1 (an int, or a string of one)."""
    if isinstance(value, bool):
        value = None
    try:
        n = int(value) if isinstance(value, int | str) else None
    except ValueError:
        n = None
    if n is None or n < 1:
        raise TraceFormatError(f"{where}: field {field} {value!r}: expected an integer >= 1")
    return n


def _wall_clock(where: str, value: str) -> float:
    """Seconds since the epoch (naive, so only differences matter) of an Azure timestamp."""
    whole, _, fraction = value.strip().partition(".")
    try:
        seconds = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
        if fraction and not fraction.isdigit():
            raise ValueError(fraction)
    except ValueError:
        raise TraceFormatError(
            f"{where}: field TIMESTAMP {value!r}: expected YYYY-MM-DD HH:MM:SS[.fraction]"
        ) from None
    return seconds + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def _from_start(path, rows: list[TraceRow]) -> list[TraceRow]:
    if not rows:
        raise TraceFormatError(f"{path}: no requests")
    rows = sorted(rows, key=lambda r: r.arrival_s)
    first = rows[0].arrival_s
    return [TraceRow(r.arrival_s - first, r.prompt_len, r.output_len, r.hash_ids) for r in rows]


def read_azure(path: str | Path) -> list[TraceRow]:
    """The requests of an Azure LLM inference trace CSV (see the module docstring)."""
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != AZURE_HEADER:
            raise TraceFormatError(
                f"{path}:1: header {header!r}: expected {','.join(AZURE_HEADER)}"
            )
        for line, fields in enumerate(reader, 2):
            if not fields or not "".join(fields).strip():
                continue
            where = f"{path}:{line}"
            if len(fields) != len(AZURE_HEADER):
                raise TraceFormatError(
                    f"{where}: {len(fields)} fields {fields!r}: expected {len(AZURE_HEADER)} "
                    f"({','.join(AZURE_HEADER)})"
                )
            rows.append(
                TraceRow(
                    _wall_clock(where, fields[0]),
                    _count(where, "ContextTokens", fields[1].strip()),
                    _count(where, "GeneratedTokens", fields[2].strip()),
                )
            )
    return _from_start(path, rows)


def _mooncake_row(where: str, line: str) -> TraceRow:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: not a JSON object ({e.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: {obj!r}: expected a JSON object")
    missing = [k for k in MOONCAKE_KEYS if k not in obj]
    if missing:
        raise TraceFormatError(
            f"{where}: field {missing[0]} missing: expected {', '.join(MOONCAKE_KEYS)}"
        )
    ms = obj["timestamp"]
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not ms >= 0:
        raise TraceFormatError(f"{where}: field timestamp {ms!r}: expected milliseconds >= 0")
    prompt_len = _count(where, "input_length", obj["input_length"])
    output_len = _count(where, "output_length", obj["output_length"])
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in ids
    ):
        raise TraceFormatError(f"{where}: field hash_ids {ids!r}: expected a list of integers")
    blocks = math.ceil(prompt_len / MOONCAKE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise TraceFormatError(
            f"{where}: field hash_ids has {len(ids)} ids: input_length {prompt_len} needs "
            f"{blocks} (one per {MOONCAKE_BLOCK_TOKENS}-token block)"
        )
    return TraceRow(ms / 1000.0, prompt_len, output_len, tuple(ids))


def read_mooncake(path: str | Path) -> list[TraceRow]:
    """The requests of a Mooncake trace JSONL file (see the module docstring)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                rows.append(_mooncake_row(f"{path}:{line_no}", line))
    return _from_start(path, rows)
