"""The costs behind hybrid mode's prefill choice (router/prefill_choice.py), learned from
what the instances report.

Samples:
- each instance's latest served step, in the stats every poll brings
  (``last_step``: ``[prefill_tokens, sum_sq, decodes, context, seconds]``, the row of
  ``instance/logs.py``; taken once per step, by ``steps_total``). A step's seconds
  are fitted per pool as a line: ``seconds = fixed + token_s x prefill_tokens (+
  decode_s x decodes on the decode pool)``; the fixed part is what any step costs
  (a small prompt's step is mostly that, so a cost per token alone would overrate it);
- each finished handoff's ``kv_bytes`` / ``transfer_s`` (the transfer's throughput, an
  exponentially weighted average), which with the decode instance's
  ``kv_bytes_per_token`` (its KV layout, ``ready()``) gives ``transfer_token_s``.

The fits are least squares over exponentially forgotten samples (each older one
weighs ``FORGET`` times less), with a weak prior (``PRIOR``: a thousandth of a
sample): a cost per prompt token of ``router.prefill_ms_per_token``, nothing else. A
coefficient the samples do not determine (a decode pool that never ran a prompt chunk)
stays at its prior; the transfer throughput's average starts at
``router.transfer_mb_per_s``.
"""

from __future__ import annotations

import numpy as np

from pdserve.router.prefill_choice import PrefillCosts

FORGET = 0.95  # weight of a sample per newer one (about the last 20 steps count)
ALPHA = 0.2  # weight of the newest handoff in the throughput's average
PRIOR = 0.001  # the prior's weight, in samples of 100 prompt tokens and 10 decodes
TOKENS, DECODES = 100.0, 10.0  # feature scales


class LineFit:
    """``seconds ~ w . (1, tokens / TOKENS, decodes / DECODES)`` (the first ``n``
    features), by ridge-regularized least squares towards ``prior`` (weight ``PRIOR``),
    samples forgotten geometrically. Invariant: ``weights()`` are >= 0."""

    def __init__(self, prior: list[float]):
        n = len(prior)
        self.prior = PRIOR * np.array(prior)
        self.xx, self.xy = PRIOR * np.eye(n), self.prior.copy()

    def add(self, features: list[float], seconds: float) -> None:
        x = np.array(features)
        self.xx = FORGET * self.xx + np.outer(x, x)
        self.xy = FORGET * self.xy + seconds * x
        n = len(x)  # the prior is not forgotten
        self.xx += (1 - FORGET) * PRIOR * np.eye(n)
        self.xy += (1 - FORGET) * self.prior

    def weights(self) -> list[float]:
        return [max(0.0, float(w)) for w in np.linalg.solve(self.xx, self.xy)]


class CostModel:
    """The learned costs; ``costs(running)`` for a decode instance running ``running``."""

    def __init__(self, prefill_ms_per_token: float, transfer_mb_per_s: float):
        token_s = prefill_ms_per_token / 1000.0
        self.local = LineFit([0.0, token_s * TOKENS, 0.0])  # (fixed, tokens, decodes)
        self.remote = LineFit([0.0, token_s * TOKENS])  # (fixed, tokens)
        self.bytes_per_s = transfer_mb_per_s * 1e6
        self.kv_bytes_per_token = 0.0  # set from the decode instances' ready() facts
        self._steps_seen: dict[str, int] = {}  # instance name -> steps_total last sampled

    def costs(self, running: int, peer_running: int | None = None) -> PrefillCosts:
        """``peer_running``: the remote side is a peer decode instance running that many
        (hybrid mode without a prefill pool), its costs the decode pool's fit."""
        fixed, tokens, decodes = self.local.weights()
        remote_fixed, remote_tokens = self.remote.weights()
        if peer_running is not None:
            remote_fixed, remote_tokens = fixed + decodes * peer_running / DECODES, tokens
        return PrefillCosts(
            local_step_s=fixed + decodes * running / DECODES,
            local_token_s=tokens / TOKENS,
            remote_step_s=remote_fixed,
            remote_token_s=remote_tokens / TOKENS,
            transfer_token_s=self.kv_bytes_per_token / self.bytes_per_s,
        )

    def observe_stats(self, name: str, role: str, stats: dict) -> None:
        """One poll's stats of instance ``name`` (role ``prefill`` or ``decode``)."""
        steps, row = stats.get("steps_total", 0), stats.get("last_step")
        if not row or self._steps_seen.get(name) == steps:
            return
        self._steps_seen[name] = steps
        prefill_tokens, _, decodes, _, seconds = row
        if role == "prefill":
            self.remote.add([1.0, prefill_tokens / TOKENS], seconds)
        else:
            self.local.add([1.0, prefill_tokens / TOKENS, decodes / DECODES], seconds)

    def observe_transfer(self, kv_bytes: int, transfer_s: float) -> None:
        """A finished handoff moved ``kv_bytes`` in ``transfer_s`` seconds."""
        if kv_bytes > 0 and transfer_s > 0:
            self.bytes_per_s = (1 - ALPHA) * self.bytes_per_s + ALPHA * kv_bytes / transfer_s
