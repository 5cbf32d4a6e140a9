"""The chaos run's gate (``gate``), and how a streamed output differs from the expected
(offline, greedy) one (``verdict``).

``verdict(expected, got)`` names the difference by the first position where the two
part, ``at``:

- ``ok``: the same tokens.
- ``duplicate``: ``got`` re-emits a run of ``run`` tokens it had already streamed
  (``got[at:at+run] == expected[at-run:at]``) and then goes on as expected (what a
  stream resumed from an earlier point than its last delivered token looks like).
- ``missing``: ``got`` skips ``run`` expected tokens at ``at`` and then goes on as
  expected (a stream resumed from a later point), or stops early (``run`` is then the
  length of the missing tail).
- ``diverged``: neither; from ``at`` on the tokens are simply different (a wrong KV
  cache, another sampling path).

Both sides run to ``max_tokens`` with ``ignore_eos``, so a stream that re-emits k
tokens ends k expected tokens early, and one that skips k goes k tokens past the
expected end (tokens the offline run never made): after the repeated or skipped run,
``got`` only has to agree with the rest of ``expected`` where both have tokens, and
a gap needs at least one token after it to be told from a divergence. The smallest
run that explains the stream wins; a duplicate is preferred to a gap when both would.

``gate(summary, kills, recover_s)``: the reasons a run failed, none when it passed. A
run passes only when at least one signal was sent (a run without a fault proves
nothing), every signalled process was seen to recover (loadgen/chaos_timeline.py: the
instance serving again, the supervisor or router answering from a new pid) within
``recover_s`` of its signal, and no request failed or mismatched, no block leaked, and
every instance's blocks were checked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

KINDS = ("ok", "duplicate", "missing", "diverged")


@dataclass(frozen=True)
class Verdict:
    kind: str  # one of KINDS
    at: int | None = None  # first position where got and expected part (None when ok)
    run: int = 0  # tokens repeated (duplicate) or skipped (missing)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.kind == "ok":
            return "ok"
        if self.kind == "diverged":
            return f"diverged at token {self.at}"
        what = "repeats" if self.kind == "duplicate" else "skips"
        return f"{self.kind}: {what} {self.run} tokens at token {self.at}"


def _agree(a: list[int], b: list[int]) -> bool:
    """``a`` and ``b`` hold the same tokens over their common length."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def verdict(expected: list[int], got: list[int]) -> Verdict:
    if got == expected:
        return Verdict("ok")
    at = 0
    while at < min(len(got), len(expected)) and got[at] == expected[at]:
        at += 1
    if at == len(got):  # got is a strict prefix of expected: its tail never came
        return Verdict("missing", at, len(expected) - at)
    for run in range(1, at + 1):
        if got[at : at + run] == expected[at - run : at] and _agree(got[at + run :], expected[at:]):
            return Verdict("duplicate", at, run)
    for run in range(1, len(expected) - at):  # at least one expected token after the gap
        if _agree(got[at:], expected[at + run :]):
            return Verdict("missing", at, run)
    return Verdict("diverged", at)


def gate(summary: dict, kills: list[dict], recover_s: float) -> list[str]:
    """Why the run failed (module docstring); ``summary``'s counts, ``kills``: the kill
    rows (``KillEvent.to_dict()`` and, when signalled, its ``recovery``)."""
    reasons = []
    if summary["kills"] == 0:
        reasons.append("no fault fired: 0 signals sent (is --kill-every shorter than the run?)")
    for k in kills:
        if k["skipped"] is not None:
            continue
        rec = k["recovery"]
        what = f"SIG{k['signal']} of {k['target']} (pid {k['pid']}) at +{k['t']:.1f} s"
        if rec["status"] != "recovered":
            reasons.append(f"{what}: {rec['status']}")
        elif rec["seconds"] > recover_s:
            reasons.append(
                f"{what}: recovered in {rec['seconds']:.1f} s, over --recover-s {recover_s:g}"
            )
    for key, label in (
        ("failed", "requests failed"),
        ("mismatched", "streams mismatched"),
        ("leaked_blocks", "blocks leaked"),
    ):
        if summary[key]:
            reasons.append(f"{summary[key]} {label}")
    if summary["unchecked_instances"]:
        names = ", ".join(summary["unchecked_instances"])
        reasons.append(f"instances whose blocks could not be checked: {names}")
    return reasons
