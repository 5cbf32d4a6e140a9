"""The served step times of an instance, with what each step computed: the samples that
``pdserve profile --served`` fits its cost model to (``planner.served``)."""

from __future__ import annotations

import threading
from collections import deque

from pdserve.engine.scheduler import StepShape


class StepLog:
    """The latest ``capacity`` steps as ``[prefill_tokens, sum_sq, decodes, context,
    seconds]``; seconds span one turn of the serving loop up to its updates (calls applied,
    the role's work between steps, the step), i.e. what a request waits per step."""

    def __init__(self, capacity: int = 50_000):
        self._rows: deque[list[float]] = deque(maxlen=capacity)
        self._lock = threading.Lock()  # the step loop records, an actor call takes

    def record(self, shape: StepShape, seconds: float) -> list[float]:
        """Keep one step; its row."""
        row = [shape.prefill_tokens, shape.sum_sq, shape.decodes, shape.context, seconds]
        with self._lock:
            self._rows.append(row)
        return row

    def take(self) -> list[list[float]]:
        """Everything recorded since the last take."""
        with self._lock:
            rows = list(self._rows)
            self._rows.clear()
        return rows
