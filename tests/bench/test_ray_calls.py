"""bench/ray_calls.py on a few items (a real embedded Ray): one row per way, each with
its figures; not their values (those are the bench's, docs/performance.md)."""

from __future__ import annotations

import pytest

from pdserve.bench import ray_calls


@pytest.mark.timeout(300)
def test_one_row_per_way(capsys):
    ray_calls.main(["--items", "20", "--updates", "2"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()]
    rows = [[c.strip() for c in r] for r in rows if r and r[0].strip() in ray_calls.WAYS]
    assert [r[0] for r in rows] == list(ray_calls.WAYS)
    assert all(float(r[1]) > 0 and float(r[2]) >= 0 and float(r[3]) >= 0 for r in rows)
