"""bench/router_replicas.py end to end on a few requests (real clusters of 1 and 2 router
replicas: Ray, gRPC, a client per load thread): the structure of what it prints and
that every request was placed by some replica, not the figures (those are the
bench's, docs/performance.md)."""

from __future__ import annotations

import pytest

from pdserve.bench import router_replicas


@pytest.mark.timeout(600)
def test_one_row_per_concurrency_and_replica_count(capsys):
    router_replicas.main(["--requests", "16", "--concurrency", "4"])
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]  # fmt: skip
    assert [(r[0], r[1]) for r in rows] == [("4", "1"), ("4", "2")]
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[7]) > 0
        assert float(r[6]) >= float(r[5]) > 0  # p99 >= p50
        placed = [int(x) for x in r[8].split(" / ")]
        assert len(placed) == int(r[1]) and sum(placed) == 16
    assert "concurrency 4: 2 replicas / 1, requests/s " in out
