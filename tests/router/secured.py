"""A cluster with API keys and TLS on, served by ``pdserve up`` in a process of its own
(its own embedded Ray, so it runs beside the package's cluster), and its test CA."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import trustme
import yaml

from tests.cluster.helpers import small_cluster_config

KEYS = ("key-alpha-0123456789", "key-beta-9876543210")
LISTENING = re.compile(r"router listening on (\S+) .* HTTP on (https?://\S+)/v1;")
UP_TIMEOUT_S = 240.0


@dataclass
class Secured:
    address: str  # gRPC host:port
    base_url: str  # https://host:port/v1
    ca_file: str  # PEM of the test CA that signed the router's certificate
    folder: Path
    process: subprocess.Popen
    output: list[str]  # what ``pdserve up`` printed so far

    @property
    def http_port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1].split("/")[0])


def write_tls(folder: Path) -> dict:
    """A test CA and a certificate for 127.0.0.1 and localhost: file paths."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: str(folder / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.private_key_pem.write_to_path(paths["key"])
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(paths["cert"], append=i > 0)
    return paths


def start(model: str, folder: Path, **router) -> Secured:
    """``pdserve up`` on a config with keys and TLS (and ``router`` keys); returns once
    it prints where it listens."""
    tls = write_tls(folder)
    key_file = folder / "keys.txt"
    key_file.write_text("# the router's keys\n\n" + "\n".join(KEYS) + "\n")
    config = small_cluster_config(model, **router)
    config["colocated"]["instances"] = 1
    config["ray"] = {"num_cpus": 1}
    config["router"].update(
        api_key_file=str(key_file), tls={"cert_file": tls["cert"], "key_file": tls["key"]}
    )
    path = folder / "secured.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cluster.cli", "up", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    output: list[str] = []

    def pump() -> None:
        for line in process.stdout:
            output.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=UP_TIMEOUT_S)
        except queue.Empty:
            stop(process)
            raise AssertionError(f"pdserve up printed no address in {UP_TIMEOUT_S} s") from None
        if line is None:
            raise AssertionError("pdserve up exited:\n" + "".join(output))
        found = LISTENING.search(line)
        if found:
            return Secured(found[1], found[2] + "/v1", tls["ca"], folder, process, output)


def stop(process: subprocess.Popen) -> int:
    """SIGTERM (``up`` drains and stops its Ray); SIGKILL to its group past 60 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return process.wait(30)
