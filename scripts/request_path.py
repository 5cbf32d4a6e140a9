"""The files one disaggregated request runs code of, counted from a real cluster: what
docs/architecture.md's walk ("One request, router to decode and back") counts.

    .venv/bin/python scripts/request_path.py [--backend gloo|grpc] [--json OUT]

It launches configs/local-disagg.yaml (the embedded model, one prefill and one decode
instance, on an embedded Ray; ``--config`` another), serves one warm-up request, then
records, in every process of the cluster and in this one (the gRPC client), each call
into a pdserve file while one chat request is served over gRPC, and the same for an
idle window as long as the request took. Counted: each file with a function that ran during the
request and not while idle (the step loops, the feeds and the stats run in both, in
the same files as the request's functions), where either the file is outside
``engine/``, or the function's caller was (the engine's API, as the serving code calls
it; the engine's compute below it is the same in both modes, docs/architecture.md).

How: Ray runs ``install`` in each worker process as it starts
(``worker_process_setup_hook``), which sets a profile function on the threads Python
starts (``threading.setprofile``: the step loops, the update feeds, the router's event
loop, gRPC's handler pool, the KV transport's threads) and waits for this script's
commands in ``$PDSERVE_REQUEST_PATH_DIR``. The request's window closes ``SETTLE_S`` after its
last token, so that its tail (the router's request line, the blocks freed) is not seen
in the idle window on a loaded host. Actor calls that Ray's own threads run
(pings, ``stats``) are not seen; the request's path does not take them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pdserve"
DIR_ENV = "PDSERVE_REQUEST_PATH_DIR"
POLL_S = 0.05


def _pdserve_file(filename: str) -> str | None:
    """``filename`` as a path relative to the repository (``router/core.py``) when it is
    a file of pdserve's, else None."""
    path = Path(filename)
    if path.suffix != ".py" or not path.is_file():
        return None  # <frozen ...>, <string>: not a file of ours
    for base in (PACKAGE, ROOT):
        try:
            rel = path.resolve().relative_to(base.resolve())
        except ValueError:
            continue
        if rel.parts and rel.parts[0] not in ("tests", "scripts", ".venv", "pdserve"):
            return rel.as_posix()
    return None


class Recorder:
    """The pdserve functions called while ``on`` (a ``sys.setprofile`` function), as
    ``file:line:name``."""

    def __init__(self):
        self.on = False
        self.files: set[str] = set()
        self._known: dict[str, str | None] = {}

    def _file(self, filename: str) -> str | None:
        if filename not in self._known:
            self._known[filename] = _pdserve_file(filename)
        return self._known[filename]

    def __call__(self, frame, event, arg):
        if not self.on or event != "call":
            return
        callee = self._file(frame.f_code.co_filename)
        if callee is None:
            return
        if callee.startswith("engine/"):
            back = frame.f_back
            caller = None if back is None else self._file(back.f_code.co_filename)
            if caller is None or caller.startswith("engine/"):
                return  # the engine's insides (or called from outside pdserve)
        code = frame.f_code
        self.files.add(f"{callee}:{code.co_firstlineno}:{code.co_name}")

    def start(self) -> None:
        sys.setprofile(self)
        threading.setprofile(self)


def install() -> None:
    """Ray's ``worker_process_setup_hook``: record in this worker when told to."""
    folder = Path(os.environ[DIR_ENV])
    recorder = Recorder()
    recorder.start()

    def follow() -> None:
        state = None
        while True:
            time.sleep(POLL_S)
            now = (folder / "phase").read_text() if (folder / "phase").exists() else ""
            if now == state:
                continue
            state = now
            if now.startswith("record"):
                recorder.files, recorder.on = set(), True
            elif now.startswith("dump"):
                recorder.on = False
                out = folder / f"{now.split()[1]}-{os.getpid()}.json"
                out.write_text(json.dumps(sorted(recorder.files)))

    threading.Thread(target=follow, name="request-path", daemon=True).start()


def _phase(folder: Path, text: str, wait_s: float = 1.0) -> None:
    (folder / "phase").write_text(text)
    time.sleep(wait_s)  # every process polls each POLL_S


def _collect(folder: Path, name: str) -> set[str]:
    files: set[str] = set()
    for path in folder.glob(f"{name}-*.json"):
        files.update(json.loads(path.read_text()))
    return files


SETTLE_S = 1.0  # the request's window stays open this long after its last token


def measure(config_path: Path, backend: str, folder: Path) -> dict:
    """Launch, warm up, record one request and an idle window; the files of the path."""
    import ray
    import yaml

    from pdserve.cluster import launch

    folder.mkdir(parents=True, exist_ok=True)
    os.environ[DIR_ENV] = str(folder)
    runtime_env = {
        "worker_process_setup_hook": "scripts.request_path.install",
        "env_vars": {DIR_ENV: str(folder), "PYTHONPATH": str(ROOT)},
    }
    init = ray.init

    def traced_init(**kwargs):  # the launcher's own ray.init, with the hook added
        return init(**kwargs, runtime_env=runtime_env)

    ray.init = traced_init
    config = yaml.safe_load(config_path.read_text())
    config["kv_transfer"]["backend"] = backend
    here = Recorder()
    ask = dict(
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=8,
        temperature=0.0,
        ignore_eos=True,
    )
    with launch(config) as cluster, cluster.client() as client:
        list(client.generate(**ask))  # warm-up
        here.start()
        _phase(folder, "record request")
        here.on = True
        started = time.monotonic()
        chunks = list(client.generate(**ask))
        took = time.monotonic() - started
        # what follows the last token (the request's log line, its blocks freed) is the
        # request's: on a loaded host it can run a while after the client has it all
        time.sleep(SETTLE_S)
        here.on = False
        _phase(folder, "dump request")
        request = _collect(folder, "request") | here.files
        here.files = set()
        _phase(folder, "record idle", 0)
        here.on = True
        time.sleep(max(took, 1.0))
        here.on = False
        _phase(folder, "dump idle")
        idle = _collect(folder, "idle") | here.files
    # a file is on the path when a function of it ran for the request and not while
    # idle: the step loop, the feeds and the stats run in both, in the same files
    path = sorted({f.split(":")[0] for f in request - idle})
    return {
        "backend": backend,
        "tokens": sum(len(c.token_ids) for c in chunks),
        "files": path,
        "count": len(path),
        "background": sorted({f.split(":")[0] for f in idle} - set(path)),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "local-disagg.yaml")
    p.add_argument("--backend", choices=["gloo", "grpc"], default="gloo")
    p.add_argument("--json", type=Path, help="write the result here too")
    p.add_argument("--dir", type=Path, help="the processes' exchange folder (a temporary one)")
    args = p.parse_args(argv)
    import tempfile

    folder = args.dir or Path(tempfile.mkdtemp(prefix="pdserve-request-path-"))
    result = measure(args.config, args.backend, folder)
    for f in result["files"]:
        print(f)
    print(f"{result['count']} files on one disaggregated request's path ({args.backend})")
    if result["background"]:
        print("ran while idle too (not counted): " + ", ".join(result["background"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
