"""Where a served request's time goes: py-spy samples of live processes (the router
actor, an engine instance) while a load runs, kept as collapsed stacks and summed up.

``record`` starts one ``py-spy record --format raw`` per process (non-blocking
sampling, every thread, idle threads left out: a sample is a thread running or ready
to run), each writing ``NAME.txt``: one line per distinct stack, ``thread;frame;...;frame
count`` (outermost frame first; the Brendan Gregg format flame graph tools read).
``summarize`` turns one such file into ``NAME-top.txt``: samples per thread, then the
functions that hold the most samples by themselves (self) and under them (total).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

RATE_HZ = 100


def py_spy() -> str:
    """The py-spy executable (the dev extra installs it)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit("--profile needs py-spy on PATH: pip install py-spy")
    return found


def record(pids: dict[str, int], seconds: int, folder: Path) -> list[subprocess.Popen]:
    """Start sampling each ``name: pid`` for ``seconds``; the running py-spy processes
    (each writes ``folder/NAME.txt`` when it ends)."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = py_spy()
    return [
        subprocess.Popen(
            [
                exe,
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(seconds),
                "--rate",
                str(RATE_HZ),
                "--format",
                "raw",
                "--threads",
                "--nonblocking",
                "--output",
                str(folder / f"{name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for name, pid in pids.items()
    ]


def stacks(raw: Path) -> Counter:
    """``(frame, ...) -> samples`` of one collapsed-stack file (thread frame first)."""
    out: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out[tuple(stack.split(";"))] += int(count)
    return out


def summarize(raw: Path, top: int = 30) -> str:
    """The summary of one collapsed-stack file: per thread, then the ``top`` functions by
    self and by total samples, each with its share of every sample taken."""
    samples = stacks(raw)
    total = sum(samples.values()) or 1
    threads, own, under = Counter(), Counter(), Counter()
    for stack, n in samples.items():
        threads[stack[0]] += n
        frames = stack[1:] or stack
        own[frames[-1]] += n
        for frame in set(frames):
            under[frame] += n
    lines = [f"{raw.stem}: {total} samples at {RATE_HZ} Hz (running or runnable threads)", ""]
    for title, counts in (("thread", threads), ("self", own), ("total", under)):
        lines.append(f"{'samples':>8} {'share':>6}  {title}")
        for name, n in counts.most_common(top):
            lines.append(f"{n:8d} {n / total:6.1%}  {name}")
        lines.append("")
    return "\n".join(lines)


def finish(procs: list[subprocess.Popen], folder: Path) -> list[Path]:
    """Wait for the samplers, write each ``NAME-top.txt``; the summaries' paths."""
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"py-spy failed ({p.returncode}): {err.decode()[-500:]}")
    written = []
    for raw in sorted(folder.glob("*.txt")):
        if raw.stem.endswith("-top"):
            continue
        summary = raw.with_name(f"{raw.stem}-top.txt")
        summary.write_text(summarize(raw))
        written.append(summary)
    return written
