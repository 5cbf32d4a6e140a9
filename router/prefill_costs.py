"""The costs behind hybrid mode's prefill choice (router/prefill_choice.py), learned from
what the instances report, as exponentially weighted averages (weight ``ALPHA`` to the
newest sample).

Samples:
- each instance's latest served step, in the stats every poll brings
  (``last_step``: ``[prefill_tokens, sum_sq, decodes, context, seconds]``, the row of
  ``engine/step_log.py``; taken once per step, by ``steps_total``). A decode
  instance's step without prompt tokens is a decode step (``decode_step_s``); with
  prompt tokens, what it took beyond a decode step (when it decoded too) is their
  cost (``local_token_s``). A prefill instance's step costs ``remote_token_s`` per token;
- each finished handoff's ``kv_bytes`` / ``transfer_s`` (the transfer's
  throughput), which with the decode instance's ``kv_bytes_per_token`` (its KV
  layout, ``ready()``) gives ``transfer_token_s``.

Until a kind of sample arrives, its cost is the config's default
(``router.prefill_ms_per_token``, ``router.transfer_mb_per_s``; no decode step cost).
"""

from __future__ import annotations

from router.prefill_choice import PrefillCosts

ALPHA = 0.2


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - ALPHA) * old + ALPHA * sample


class CostModel:
    """Invariant: every estimate is None (no sample yet) or a finite number >= 0."""

    def __init__(self, prefill_ms_per_token: float, transfer_mb_per_s: float):
        self.default_token_s = prefill_ms_per_token / 1000.0
        self.default_bytes_per_s = transfer_mb_per_s * 1e6
        self.local_token_s: float | None = None
        self.remote_token_s: float | None = None
        self.decode_step_s: float | None = None
        self.bytes_per_s: float | None = None
        self.kv_bytes_per_token = 0.0  # set from the decode instances' ready() facts
        self._steps_seen: dict[str, int] = {}  # instance name -> steps_total last sampled

    def costs(self) -> PrefillCosts:
        token_s = self.default_token_s
        bytes_per_s = self.bytes_per_s or self.default_bytes_per_s
        return PrefillCosts(
            local_token_s=self.local_token_s if self.local_token_s is not None else token_s,
            remote_token_s=self.remote_token_s if self.remote_token_s is not None else token_s,
            decode_step_s=self.decode_step_s or 0.0,
            transfer_token_s=self.kv_bytes_per_token / bytes_per_s,
        )

    def observe_stats(self, name: str, role: str, stats: dict) -> None:
        """One poll's stats of instance ``name`` (role ``prefill`` or ``decode``)."""
        steps, row = stats.get("steps_total", 0), stats.get("last_step")
        if not row or self._steps_seen.get(name) == steps:
            return
        self._steps_seen[name] = steps
        prefill_tokens, _, decodes, _, seconds = row
        if role == "prefill":
            if prefill_tokens:
                self.remote_token_s = _ewma(self.remote_token_s, seconds / prefill_tokens)
        elif not prefill_tokens:
            if decodes:
                self.decode_step_s = _ewma(self.decode_step_s, seconds)
        else:
            beyond = max(0.0, seconds - (self.decode_step_s or 0.0) * (decodes > 0))
            self.local_token_s = _ewma(self.local_token_s, beyond / prefill_tokens)

    def observe_transfer(self, kv_bytes: int, transfer_s: float) -> None:
        """A finished handoff moved ``kv_bytes`` in ``transfer_s`` seconds."""
        if kv_bytes > 0 and transfer_s > 0:
            self.bytes_per_s = _ewma(self.bytes_per_s, kv_bytes / transfer_s)
