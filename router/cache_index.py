"""The router's copy of one instance's prefix cache: the block hashes it holds, kept up
to date from the ``CacheDelta`` each poll brings (instance/logs.py publishes them;
docs/serving.md, "Cache-aware routing").

The view lags the instance by at most one poll (one engine step): a hit it predicts may
have been evicted since, and blocks registered since are not yet predicted. Either
way the instance's own cache decides what is reused; the view only steers routing.
"""

from __future__ import annotations

from pdserve.instance.messages import CacheCursor, CacheDelta


class CacheIndex:
    def __init__(self):
        self.cursor = CacheCursor()  # of the last delta applied: none yet (a snapshot comes)
        self.hashes: set[int] = set()

    def apply(self, delta: CacheDelta | None) -> None:
        """One poll's changes (None: the poll carried none)."""
        if delta is None:
            return
        if not delta.snapshot and delta.epoch != self.cursor.epoch:
            raise ValueError(
                f"cache delta of epoch {delta.epoch!r} applied to a view of epoch "
                f"{self.cursor.epoch!r}: only a snapshot may start a new epoch"
            )
        delta.apply_to(self.hashes)
        self.cursor = delta.cursor

    def hit_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a sequence whose block hashes are ``hashes`` the
        instance holds (the engine reuses only a leading run)."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n
