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
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    address: str  # gRPC host:port
    http_address: str  # HTTP host:port


@contextlib.contextmanager
def pdserve_up(config: dict, folder: Path):
    """Serve ``config`` (written into ``folder``) until the block ends, then SIGTERM
    (drain and stop; SIGKILL of its process group past 90 s or on a failure)."""
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    ray_base = tempfile.mkdtemp(prefix="pdu-", dir="/tmp")  # short: Ray's socket paths
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "up", str(path)],
        cwd=ROOT,
        env={**os.environ, "PDSERVE_RAY_TMPDIR": ray_base},
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
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe open
        yield Served(found.group(1), found.group(2))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(ray_base, ignore_errors=True)
