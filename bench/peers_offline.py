"""The offline half of ``bench/peers.py``: each system's ``bench/peers_driver.py`` in a
process of its own (its own venv, ``--threads`` threads), all loaded and warmed up at
once, then measured in turn: per repetition, per row, each system after the other,
with ``SETTLE_S`` of quiet before each (vLLM's processes spin for a second after their
last step). A row's figure is the best of its repetitions; every one is kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.bench.engine import LIBRARY_CAPS
from pdserve.bench.peers_driver import MARK
from pdserve.bench.peers_report import check_figure
from pdserve.engine import native

DRIVER = Path(__file__).with_name("peers_driver.py")
REPO = DRIVER.parent.parent
SETTLE_S = 2.0
READY_TIMEOUT_S = 900.0  # vLLM: 1-3 minutes of start-up and compilation, more when busy
ROW_TIMEOUT_S = 600.0


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without its venv's marks, plus ``extra``."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


class Driver:
    """A running ``peers_driver.py``: its ``PEERS`` lines through ``ask``/``wait``, the
    rest of its output into ``log_path``."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path):
        self.name, self.log_path = name, log_path
        self._lines: queue.Queue = queue.Queue()
        self._log = open(log_path, "w")  # noqa: SIM115 (closed by the reader at EOF)
        self._log.write(" ".join(cmd) + "\n")
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            if line.startswith(MARK):
                self._lines.put(json.loads(line[len(MARK) :]))
            else:
                self._log.write(line)
                self._log.flush()
        self._lines.put(None)
        self._log.close()

    def wait(self, timeout_s: float) -> dict:
        """The driver's next message; RuntimeError when it exits or is silent too long."""
        try:
            message = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            message = None
        if message is None:
            self.close()
            raise RuntimeError(f"{self.name}'s driver stopped answering; see {self.log_path}")
        return message

    def ask(self, command: dict, timeout_s: float = ROW_TIMEOUT_S) -> dict:
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self.wait(timeout_s)

    def close(self) -> None:
        """Ask it to quit and wait up to 60 s, then kill what is left of its process
        group (vLLM's engine process outlives a driver killed alone)."""
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if self._proc.poll() is None:
                self._proc.stdin.write('{"quit": true}\n')
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()


def driver_command(python: str, system: str, model: str, args, max_id: int) -> list[str]:
    """``peers_driver.py`` under ``python``; ``-P``: the script's folder (bench/, whose
    ``datasets.py`` would shadow HF's) is not put on ``sys.path``."""
    flags = {
        "--system": system,
        "--model": model,
        "--rows": ",".join(args.rows),
        "--context": str(args.context),
        "--steps": str(args.decode_steps),
        "--threads": str(args.threads),
        "--max-id": str(max_id),
    }
    return [python, "-P", str(DRIVER), *(part for pair in flags.items() for part in pair)]


def measure_offline(
    systems: dict[str, tuple[list[str], dict]], args, ceiling: float, out: Path, log
) -> dict:
    """Per system (name -> (driver command, env)): ``{"info": ready message, "rows":
    {row: {"best": tok/s or None, "reps": [...], "skipped": why or None}}}``. Raises
    ``bench.peers_report.Impossible`` on a figure past ``ceiling`` tok/s or a time
    that is not positive."""
    drivers: dict[str, Driver] = {}
    try:
        for name, (cmd, env) in systems.items():
            drivers[name] = Driver(name, cmd, env, out / f"offline-{name}.log")
        results = {}
        for name, driver in drivers.items():
            info = driver.wait(READY_TIMEOUT_S)
            facts = ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("ready", "load_s"))
            log(f"offline: {name} loaded and warmed up in {info['load_s']:.0f} s ({facts})")
            results[name] = {
                "info": info,
                "rows": {row: {"best": None, "reps": [], "skipped": None} for row in args.rows},
            }
        for rep in range(args.repeats):
            for row in args.rows:
                for name, driver in drivers.items():
                    entry = results[name]["rows"][row]
                    if entry["skipped"]:
                        continue
                    time.sleep(SETTLE_S)
                    got = driver.ask({"row": row, "rep": rep})
                    if "skipped" in got:
                        entry["skipped"] = got["skipped"]
                        log(f"offline: {name} {row}: skipped ({got['skipped']})")
                        continue
                    tok_s = check_figure(f"{name} {row}", got["tokens"], got["seconds"], ceiling)
                    entry["reps"].append(got)
                    entry["best"] = max(entry["best"] or 0.0, tok_s)
                    log(
                        f"offline: rep {rep + 1}/{args.repeats} {row:<13} {name:<9} "
                        f"{tok_s:8.1f} tok/s ({got['seconds']:.2f} s)"
                    )
        return results
    finally:
        for driver in drivers.values():
            driver.close()


def vllm_isa_env() -> dict[str, str]:
    """Where pdserve's kernels are forced to AVX2 on a CPU with AVX-512
    (``PDSERVE_CPU_ISA=avx2``), vLLM is capped the same way: its kernel build
    (bench/vllm_avx2/sitecustomize.py), torch, MKL and oneDNN (bench/engine.py's
    LIBRARY_CAPS), so that both run as on a CPU without AVX-512."""
    if native.isa() != "avx2" or native.supported()[-1] == "avx2":
        return {}
    return {"PYTHONPATH": str(Path(__file__).with_name("vllm_avx2")), **LIBRARY_CAPS["avx2"]}


def systems_to_run(args, folder: Path, gguf: Path | None, max_id: int) -> dict:
    """name -> (driver command, env): pdserve (this interpreter), vLLM (``--vllm-venv``)
    and llama.cpp (``--llama-cpp-venv``, on the GGUF file) when given."""
    # vLLM's model on the same number of CPUs as pdserve's threads (its own default on
    # 2 CPUs, "auto", keeps one for its engine process: --vllm-omp-bind auto)
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[: args.threads]))
    vllm_env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_bind or cpus,
        **vllm_isa_env(),
    }
    out = {
        "pdserve": (
            driver_command(sys.executable, "pdserve", str(folder), args, max_id),
            clean_env(PYTHONPATH=str(REPO)),
        ),
        "vllm": (
            driver_command(
                str(Path(args.vllm_venv) / "bin" / "python"), "vllm", str(folder), args, max_id
            ),
            clean_env(**vllm_env),
        ),
    }
    if gguf is not None:
        python = str(Path(args.llama_cpp_venv) / "bin" / "python")
        out["llama.cpp"] = (
            driver_command(python, "llama_cpp", str(gguf), args, max_id),
            clean_env(),
        )
    return out
