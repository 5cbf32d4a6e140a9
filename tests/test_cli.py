"""The offline ``pdserve generate`` command, as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def test_offline_chat_generation():
    cmd = [sys.executable, "-m", "pdserve.cluster.cli", "generate", "--offline", "--chat"]
    cmd += ["--max-tokens", "16", "What is the capital of France?"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "The capital of France is Paris." in done.stdout
    assert "TTFT" in done.stdout and "finish stop" in done.stdout


def test_offline_rejects_bad_arguments():
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cluster.cli",
        "generate",
        "--offline",
        "--max-tokens",
        "0",
        "hi",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "max_tokens=0" in done.stderr
