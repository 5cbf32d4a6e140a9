"""bench/serving_overhead.py end to end in its quick mode (a real cluster: Ray, gRPC,
HTTP), and its profile summary on a collapsed-stack file; the structure of what they
print, not the figures (those are the bench's, docs/performance.md)."""

from __future__ import annotations

import pytest

from pdserve.bench import serving_overhead, serving_profile


@pytest.mark.timeout(600)
def test_quick_mode_prints_every_path_at_every_concurrency(capsys):
    serving_overhead.main(["--quick"])
    out = capsys.readouterr().out
    assert "### colocated: 24 requests" in out
    assert "decode: " in out and "prefill GEMM: " in out  # the CPU path that ran
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows if row[0].strip().isdigit()]
    assert [(r[0], r[1]) for r in rows] == [
        (c, path)
        for c in ("1", "4")
        for path in ("offline", "direct", "grpc floor", "grpc", "http")
    ]
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) >= float(r[3])
        routed = r[1] in ("grpc", "http")
        assert bool(r[5]) == routed and bool(r[8]) == routed  # added latency, vs direct
        assert bool(r[7]) == (r[1] not in ("offline", "grpc floor"))  # against offline
        assert bool(r[12]) == (r[1] != "offline")  # CPU per request: the instances', the server's
        if r[1] != "grpc floor":  # the echo has no instance behind it
            assert float(r[11]) > 0
        assert bool(r[13]) == (r[1] != "offline")  # the caller's CPU per request
        if r[1] in ("grpc floor", "grpc"):
            assert float(r[12]) > 0  # the echo's, the router's
    for c in ("1", "4"):  # the router's CPU split into the floor and its own
        assert f"concurrency {c}: router CPU " in out and "+ the router's own" in out


def test_profile_summary_counts_threads_self_and_total(tmp_path):
    raw = tmp_path / "router.txt"
    raw.write_text(
        "thread (1): loop;run (a.py:1);poll (b.py:2) 30\n"
        "thread (1): loop;run (a.py:1) 10\n"
        "thread (2): worker;tokenize (c.py:3) 60\n"
    )
    text = serving_profile.summarize(raw)
    assert text.startswith("router: 100 samples")
    thread, own, total = text.split("\n\n")[1:4]
    assert "60  60.0%  thread (2): worker" in thread
    assert own.splitlines()[1].endswith("tokenize (c.py:3)")
    assert "40  40.0%  run (a.py:1)" in total
