"""bench/engine.py's second section: the engine against HF on a second family's tiny
checkpoint, run here with the smallest sizes (the numbers themselves are the bench's)."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.engine import family_rows, prompt_ids


def test_prompts_stay_inside_the_vocabulary():
    assert max(prompt_ids(512, 256)) < 256 and min(prompt_ids(512, 256)) >= 100
    # the embedded model's prompts are those of the earlier runs (docs/performance.md)
    assert prompt_ids(2048, 49152) == [(7 * i) % 40000 + 100 for i in range(2048)]


@pytest.mark.timeout(240)
def test_gemma2_section_runs_on_the_torch_layers(capsys):
    rows = family_rows("gemma2", steps=2, repeats=1, prefills=(16,), batches=(1, 2))
    assert [r[0] for r in rows] == ["prefill 16", "decode batch 1", "decode batch 2"]
    for _, ours, theirs, _ in rows:
        assert math.isfinite(ours) and ours > 0 and math.isfinite(theirs) and theirs > 0
    assert rows[1][3].endswith("ms/step")
    assert "decode path: per-op torch layers" in capsys.readouterr().out
