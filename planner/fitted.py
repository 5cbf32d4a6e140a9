"""A cost model fitted to measurements (``planner.profile``): linear in what each step
does, per tensor-parallel degree, by least squares.

    prefill_s = a + b x tokens + c x sum_sq      decode_s = a + b x batch + c x context
    transfer_s = a + b x bytes
    mixed_s = a + b x tokens + c x sum_sq + d x batch + e x context   (co-located steps)

Without a ``mixed`` fit (an offline profile), a co-located step is ``prefill_s +
decode_s``; a served profile (``planner.served``) fits the steps an instance
actually mixed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


def fit_linear(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares of ``times`` on [1, *row]; a coefficient that comes out negative is
    dropped (set to 0) and the rest refitted, so that no cost falls as work grows."""
    x = np.array([[1.0, *r] for r in rows])
    y = np.array(times)
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        bad = [k for k, c in zip(keep, coef, strict=True) if c < 0 and k != 0]
        if not bad:
            out = [0.0] * x.shape[1]
            for k, c in zip(keep, coef, strict=True):
                out[k] = max(0.0, float(c))
            return out
        keep.remove(bad[0])


@dataclass
class FittedCost:
    prefill: dict[int, list[float]]  # tp -> [a, per token, per sum_sq]
    decode: dict[int, list[float]]  # tp -> [a, per sequence, per context token]
    transfer: list[float]  # [a, per byte]
    kv_bytes_per_token: int
    kv_capacity: dict[int, int]  # tp -> KV tokens one instance holds
    meta: dict = field(default_factory=dict)  # what was measured, how, and the points
    mixed: dict[int, list[float]] = field(default_factory=dict)  # tp -> [a, b, c, d, e]

    def prefill_s(self, tokens: int, sum_sq: float, tp: int = 1) -> float:
        if tokens <= 0:
            return 0.0
        a, b, c = self.prefill[tp]
        return a + b * tokens + c * sum_sq

    def decode_s(self, batch: int, context: int, tp: int = 1) -> float:
        if batch <= 0:
            return 0.0
        a, b, c = self.decode[tp]
        return a + b * batch + c * context

    def mixed_s(self, tokens: int, sum_sq: float, batch: int, context: int, tp: int = 1) -> float:
        if tp not in self.mixed:
            return self.prefill_s(tokens, sum_sq, tp) + self.decode_s(batch, context, tp)
        if tokens <= 0 and batch <= 0:
            return 0.0
        a, b, c, d, e = self.mixed[tp]
        return a + b * tokens + c * sum_sq + d * batch + e * context

    def transfer_s(self, nbytes: float) -> float:
        a, b = self.transfer
        return a + b * nbytes if nbytes > 0 else 0.0

    def transfer_bytes(self, tokens: int, decode_tp: int) -> int:
        """The profiled engine's per-head K/V layout: every head moves once, any degree."""
        return tokens * self.kv_bytes_per_token

    def kv_capacity_tokens(self, tp: int) -> int:
        """0 for a degree not profiled: the search skips it."""
        return self.kv_capacity.get(tp, 0) if tp in self.prefill else 0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> FittedCost:
        d = json.loads(Path(path).read_text())
        for key in ("prefill", "decode", "kv_capacity", "mixed"):
            d[key] = {int(k): v for k, v in d.get(key, {}).items()}
        return cls(**d)
