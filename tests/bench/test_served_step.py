"""bench/served_step.py end to end on a tiny model (a real cluster: Ray, the router's
own consumer of the instance's updates): one row per batch and the prefill, each with
both sides measured; the structure of what it prints, not the figures (those are the
bench's, docs/performance.md)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import served_step
from tests.tiny_models import TINY_SHAPES, save_tiny_chat_llama


@pytest.mark.timeout(300)
def test_one_row_per_batch_and_the_prefill(tmp_path, capsys):
    save_tiny_chat_llama(tmp_path, **TINY_SHAPES["gqa2"])
    config = json.loads((tmp_path / "config.json").read_text())
    config["max_position_embeddings"] = 16384  # its batches outlast the windows on a fast CPU
    (tmp_path / "config.json").write_text(json.dumps(config))
    served_step.main(["--model", str(tmp_path), "--batches", "1,4", "--prefill-tokens", "48",
                      "--window-s", "0.3", "--rounds", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert "decode: " in out and "prefill GEMM: " in out  # the CPU path that ran
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| decode") or line.startswith("| prefill")]  # fmt: skip
    assert [r[0] for r in rows] == ["decode step, batch 1", "decode step, batch 4",
                                    "prefill, 48 tokens"]  # fmt: skip
    for r in rows:
        for pair in (r[1], r[2]):  # best <= median, both measured
            best, median = (float(x) for x in pair.split(" / "))
            assert 0 < best <= median, r
        assert float(r[3]) > 0 and float(r[4]) > 0
