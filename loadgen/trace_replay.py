"""Replay of a production trace (workloads ``azure``, ``mooncake``): a window of it,
scaled in time and in tokens, with prompts of real text (docs/benchmarks.md,
"Production traces").

    spec = WorkloadSpec("mooncake", trace="traces/mooncake-fast25-conversation.jsonl",
                        trace_start_s=600, trace_duration_s=30, time_scale=4,
                        token_scale=1 / 32)
    window = trace_window(spec)           # which requests, at which scales
    reqs = trace_requests(spec, tokenizer, max_model_len)

- Window: the requests that arrive in ``[trace_start_s, trace_start_s +
  trace_duration_s)`` seconds after the trace's first request (to its end with no
  duration).
- Time scale: a request arrives ``(its trace time - trace_start_s) * time_scale``
  seconds after the replay starts: every gap is multiplied by ``time_scale`` (4: the
  same bursts and lulls, four times as long, at a quarter of the rate). Arrivals are the
  trace's own, never re-drawn.
- Token scale: prompt and output lengths are multiplied by ``token_scale`` and rounded
  (at least 1 token each); then the spec's caps (``max_prompt_tokens``,
  ``max_output_tokens``) apply, then a prompt + output longer than the model's context
  keeps its output (at most context - 1) and loses the prompt's tail.
- Prompts are token ids of ShareGPT text, drawn in an order seeded by the spec's seed
  alone (same seed, same prompts; no rate is in it: a replay has one pace). Azure: each
  request its own stretch of text. Mooncake: a hash id is one block of ``block_tokens =
  max(1, round(512 * token_scale))`` tokens of text, the same wherever the id occurs and
  unlike every other id's; a prompt is its ids' blocks in order, the last one cut to the
  scaled length of the trace's last (partial) block. So two prompts whose ``hash_ids``
  share a leading run of r ids share exactly their first ``r * block_tokens`` token ids
  (before the context cut), and a prefix cache or a cache-aware router sees the trace's reuse.
- The warm-up (``warmup_requests``) is the window's first requests, all at once, of
  text from another seed: it reaches no prefix of the replay.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass

from pdserve.loadgen.trace_formats import MOONCAKE_BLOCK_TOKENS, TraceRow, read_azure, read_mooncake
from pdserve.loadgen.workloads import (
    PRODUCTION_TRACES,
    Request,
    WorkloadSpec,
    fit_prompt,
    token_pool,
)

READERS = {"azure": read_azure, "mooncake": read_mooncake}  # keys: PRODUCTION_TRACES


@functools.lru_cache(maxsize=4)
def _read(name: str, path: str, mtime_ns: int, size: int) -> tuple[TraceRow, ...]:
    return tuple(READERS[name](path))


def read_rows(name: str, path: str) -> tuple[TraceRow, ...]:
    """The trace's rows (a file read again only when it changed)."""
    st = os.stat(path)
    return _read(name, str(path), st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class TraceWindow:
    """The requests a replay sends, at its scales. Invariant: every row's arrival is in
    ``[start_s, start_s + duration_s)``; ``duration_s > 0``."""

    workload: str
    trace: str
    start_s: float  # trace seconds after its first request
    duration_s: float  # trace seconds
    trace_span_s: float  # the whole trace's, first to last arrival
    time_scale: float
    token_scale: float
    rows: tuple[TraceRow, ...]

    @property
    def replay_s(self) -> float:
        return self.duration_s * self.time_scale

    @property
    def offered_rate(self) -> float:
        """Requests per second of the replay (the window's mean, scaled)."""
        return len(self.rows) / self.replay_s

    def describe(self) -> str:
        return (
            f"{self.workload} trace {os.path.basename(self.trace)}, window "
            f"{self.start_s:g}-{self.start_s + self.duration_s:g} s of {self.trace_span_s:.0f} s, "
            f"time scale {self.time_scale:g} (gaps x{self.time_scale:g}), token scale "
            f"{self.token_scale:g}: {len(self.rows)} requests over {self.replay_s:g} s "
            f"({self.offered_rate:.3g}/s offered)"
        )

    def to_dict(self) -> dict:
        return {
            "workload": self.workload,
            "trace": self.trace,
            "start_s": self.start_s,
            "duration_s": self.duration_s,
            "time_scale": self.time_scale,
            "token_scale": self.token_scale,
            "requests": len(self.rows),
            "replay_s": self.replay_s,
            "offered_rate": self.offered_rate,
            "summary": self.describe(),
        }


def trace_window(spec: WorkloadSpec) -> TraceWindow:
    """The spec's window of its trace; ValueError naming the key when it holds nothing."""
    if spec.name not in PRODUCTION_TRACES:
        raise ValueError(f"workload {spec.name!r}: expected one of {', '.join(READERS)}")
    rows = read_rows(spec.name, spec.trace)
    span = rows[-1].arrival_s
    start = spec.trace_start_s
    if start > span:
        raise ValueError(
            f"trace_start_s {start:g}: past the trace's last arrival; allowed 0 to {span:g}"
        )
    # no duration: to the end (one gap of the mean past the last arrival, so it is in)
    duration = spec.trace_duration_s or (span - start + max(span / len(rows), 1e-3))
    inside = tuple(r for r in rows if start <= r.arrival_s < start + duration)
    if not inside:
        raise ValueError(
            f"trace window {start:g}-{start + duration:g} s (trace_start_s, "
            f"trace_duration_s): no request of {spec.trace} arrives in it"
        )
    return TraceWindow(
        spec.name, spec.trace, start, duration, span, spec.time_scale, spec.token_scale, inside
    )


def block_tokens(token_scale: float) -> int:
    """Tokens of one scaled Mooncake block."""
    return max(1, round(MOONCAKE_BLOCK_TOKENS * token_scale))


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def _mooncake_parts(row: TraceRow, scale: float) -> list[tuple[int, int]]:
    """(hash id, tokens of its block in this prompt) of a row: whole scaled blocks, the
    last one cut to its scaled share."""
    size = block_tokens(scale)
    tail = row.prompt_len - MOONCAKE_BLOCK_TOKENS * (len(row.hash_ids) - 1)
    last = min(size, _scaled(tail, scale))
    return [(h, size) for h in row.hash_ids[:-1]] + [(row.hash_ids[-1], last)]


def _prompts(
    window: TraceWindow, rows: tuple[TraceRow, ...], tokenizer, rng, limit
) -> list[list[int]]:
    scale = window.token_scale
    if window.workload == "azure":
        lengths = [_scaled(r.prompt_len, scale) for r in rows]
        pool = token_pool(tokenizer, sum(lengths), rng, limit)
        out, at = [], 0
        for n in lengths:
            out.append([pool[(at + k) % len(pool)] for k in range(n)])
            at += n
        return out
    size = block_tokens(scale)
    parts = [_mooncake_parts(r, scale) for r in rows]
    ids = list(dict.fromkeys(h for p in parts for h, _ in p))
    blocks = dict(zip(ids, _distinct_blocks(tokenizer, len(ids), size, rng, limit), strict=True))
    return [[t for h, n in p for t in blocks[h][:n]] for p in parts]


def _distinct_blocks(tokenizer, n: int, size: int, rng, limit) -> list[list[int]]:
    """n blocks of ``size`` tokens, consecutive stretches of the text, no two equal (real
    text repeats itself: a log line, a boilerplate paragraph), so that two hash ids
    never meet in a prefix cache by chance."""
    pool = token_pool(tokenizer, n * size + n * size // 4 + 1024 * size, rng, limit)
    out, seen = [], set()
    for at in range(0, len(pool) - size + 1, size):
        block = tuple(pool[at : at + size])
        if block not in seen:
            seen.add(block)
            out.append(list(block))
            if len(out) == n:
                return out
    raise ValueError(
        f"token_scale: blocks of {size} tokens, fewer than the window's {n} distinct hash "
        "ids differ in the text drawn; raise token_scale or shorten the window"
    )


def _requests(
    spec: WorkloadSpec, window, rows, tokenizer, max_model_len: int, seed: str, at_once: bool
) -> list[Request]:
    rng = random.Random(seed)
    prompts = _prompts(window, rows, tokenizer, rng, spec.dataset_limit)
    out = []
    for row, ids in zip(rows, prompts, strict=True):
        out_len = _scaled(row.output_len, window.token_scale)
        if spec.max_prompt_tokens:
            ids = ids[: spec.max_prompt_tokens]
        if spec.max_output_tokens:
            out_len = min(out_len, spec.max_output_tokens)
        t = 0.0 if at_once else (row.arrival_s - window.start_s) * window.time_scale
        out.append(Request(t, *fit_prompt(ids, out_len, max_model_len)))
    return out


def trace_requests(spec: WorkloadSpec, tokenizer, max_model_len: int) -> list[Request]:
    """The window's requests, scaled, in arrival order (see the module docstring)."""
    window = trace_window(spec)
    return _requests(
        spec, window, window.rows, tokenizer, max_model_len, f"{spec.seed}-trace", False
    )


def warmup_requests(spec: WorkloadSpec, tokenizer, n: int, max_model_len: int) -> list[Request]:
    """The window's first n requests (cycled when it holds fewer), all at 0, of text from
    another seed than the replay's."""
    window = trace_window(spec)
    rows = tuple(window.rows[i % len(window.rows)] for i in range(n))
    return _requests(spec, window, rows, tokenizer, max_model_len, f"{spec.seed}-warmup", True)
