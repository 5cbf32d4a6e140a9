"""A cluster served by ``pdserve up`` in a process of its own, for a test module that
needs a config of its own while this folder's cluster may be up in the test process
(a process has one embedded Ray)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    address: str  # gRPC host:port
    http_address: str  # HTTP host:port
    pid: int  # of the ``pdserve up`` process
    exit_code: int | None = None  # once stopped
    output: list[str] = field(default_factory=list)  # its stdout and stderr lines


@contextlib.contextmanager
def pdserve_up(
    config: dict, folder: Path, env: dict | None = None, stop: signal.Signals = signal.SIGTERM
):
    """Serve ``config`` (written into ``folder``; ``env`` added to this environment)
    until the block ends, then send ``stop`` (SIGTERM or SIGINT: drain and stop; SIGKILL
    of its process group past 90 s or on a failure); ``Served.exit_code`` and ``output``
    tell how it ended."""
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    ray_base = tempfile.mkdtemp(prefix="pdu-", dir="/tmp")  # short: Ray's socket paths
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cluster.cli", "up", str(path)],
        cwd=ROOT,
        env={**os.environ, "PDSERVE_RAY_TMPDIR": ray_base, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: Ray's processes join it
    )
    try:
        lines, found, deadline = [], None, time.monotonic() + 180
        while found is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"listening on (\S+) .* HTTP on http://(\S+)/v1;", line)
        assert found, "".join(lines)
        served = Served(found.group(1), found.group(2), proc.pid, output=lines)
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()  # keeps its pipe drained
        yield served
        proc.send_signal(stop)
        served.exit_code = proc.wait(timeout=90)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(ray_base, ignore_errors=True)
