"""The mixed short/long trace (bench/mixed_trace.py) reads back as a ``trace`` workload."""

from __future__ import annotations

from pdserve.bench.mixed_trace import main, mixed_trace
from pdserve.loadgen.datasets import read_trace


def test_mixed_trace_is_seeded_and_reads_back(tmp_path):
    rows = mixed_trace(400, long_share=0.25, short=40, long=800, output=30, seed=3)
    assert rows == mixed_trace(400, long_share=0.25, short=40, long=800, output=30, seed=3)
    long = [r for r in rows if r["prompt_len"] >= 400]  # long: 400..1200, short: 20..60
    assert all(20 <= r["prompt_len"] <= 60 for r in rows if r not in long)
    assert 0.18 < len(long) / len(rows) < 0.32
    assert all(15 <= r["output_len"] <= 45 for r in rows)
    path = tmp_path / "mixed.jsonl"
    main(["--out", str(path), "-n", "50", "--seed", "3"])
    entries = read_trace(path)
    assert len(entries) == 50 and entries[0].arrival_s == 0.0
    assert all(e.prompt_len and e.output_len for e in entries)
