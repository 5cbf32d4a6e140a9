"""docs/architecture.md's count of the files on one disaggregated request's path is the
one ``scripts/request_path.py`` measures on a real cluster (the tiny model in place of
the embedded one: the path does not depend on the model)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_documented_count_is_the_measured_one(chat_model, tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "local-disagg.yaml").read_text())
    config["model"] = chat_model
    config["router"].update(port=0, http_port=0)
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "path.json"
    script = ROOT / "scripts" / "request_path.py"
    args = [sys.executable, str(script), "--config", str(path), "--json", str(out)]
    done = subprocess.run(args, cwd=ROOT, timeout=240, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tokens"] == 8
    core = {"router/core.py", "instance/worker.py", "engine/llm_engine.py"}
    assert core | {"kv_transfer/gloo_sender.py", "kv_transfer/gloo_receiver.py"} <= set(
        result["files"]
    )
    doc = (ROOT / "docs" / "architecture.md").read_text()
    documented = re.search(r"(\d+) files on one disaggregated request's path", doc)
    assert documented, "docs/architecture.md states no measured count"
    assert int(documented.group(1)) == result["count"], result["files"]
