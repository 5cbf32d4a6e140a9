"""``pdserve chaos`` end to end on the tiny model, with no kills: every stream completes
with the expected greedy tokens, no block leaks, and the figures and the plot are
written (the kills themselves need the supervision this tool measures)."""

from __future__ import annotations

import json

import yaml

from bench.chaos_report import JSON_NAME, PLOT_NAME
from cluster.cli import main
from tests.cluster.helpers import small_cluster_config


def test_chaos_without_kills_reports_every_stream_complete_and_as_expected(
    chat_model, tmp_path, capsys
):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(small_cluster_config(chat_model)))
    out = tmp_path / "chaos"
    code = main(["chaos", str(config), "--requests", "8", "--rate", "16", "--arrivals",
                 "constant", "--max-tokens", "8", "--max-prompt-tokens", "24",
                 "--kill-every", "0", "--settle-s", "10", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    results = json.loads((out / JSON_NAME).read_text())
    s = results["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["migrated"]) == (8, 8, 0, 0), s
    assert (s["mismatched"], s["leaked_blocks"], s["unchecked_instances"]) == (0, 0, []), s
    assert s["passed"] and results["kills"] == [] and results["settled"]
    assert all(len(r["token_ids"]) == 8 and r["verdict"]["kind"] == "ok"
               for r in results["requests"])  # fmt: skip
    assert set(results["integrity"]) == {"colocated-0", "colocated-1"}
    assert all(i["leaked"] == 0 for i in results["integrity"].values())
    samples = [t for t in results["timeline"] if not t["error"]]
    assert samples and all(t["live"] == 2 for t in samples)
    assert (out / PLOT_NAME).read_bytes().startswith(b"\x89PNG")
    assert "chaos: passed" in printed
