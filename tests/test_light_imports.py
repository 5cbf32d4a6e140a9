"""What a process that only routes or holds handles loads: the router's process and
every process that deserializes an instance's actor handle (Ray loads the actor's class
for it) import ``pdserve.router.server`` and ``pdserve.instance.worker``; neither may
pull in torch (about a CPU-second at each start, and a restarted router serves later by
as much). The engine loads torch where it computes (``EngineWorker.__init__``), the KV
transport where a layout meets a tensor."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = [
    "pdserve.router.server",
    "pdserve.instance.worker",
    "pdserve.cluster.supervisor",
    "pdserve.engine.checkpoint",
    "pdserve.engine.structured",
    "pdserve.kv_transfer",  # the supervisor reads an instance's endpoint with it
]


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_without_torch(module):
    loaded = "sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3]"
    code = f"import sys, {module}; print({loaded})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} imports torch: {out.stdout.strip()}"
