"""C sources of the engine's CPU kernels, built on first use, once per ISA, and loaded
with ctypes.

The sources (``SOURCES``, with the headers beside them) are compiled together with the
system C compiler (``$CC``, else ``cc``) into one shared library per instruction set
(``ISAS``): AVX2 + FMA (``-march=x86-64-v3``: Haswell, AMD Zen 1-3 and most cloud VMs),
AVX-512 F/BW/DQ/VL (``-march=x86-64-v4``: Skylake-SP and later Xeons, Zen 4/5) and AMX
(``-march=sapphirerapids``). ``isa()`` picks the best one the CPU has, at run time,
from the flags the kernel reports from CPUID (``/proc/cpuinfo``); ``PDSERVE_CPU_ISA``
forces another one the CPU has (a test, a benchmark of the AVX2 path on an AVX-512
machine). A library is cached under ``$PDSERVE_KERNEL_CACHE`` (default
``~/.cache/pdserve/kernels``), named by a hash of the sources, the headers, the flags
and the CPU: a few seconds once per machine and ISA, no torch headers. Its OpenMP is
the libgomp torch has already loaded, so it shares torch's thread pool.

When there is no compiler, the build fails, or the CPU has none of these ISAs,
``library()`` returns None (with one warning) and the callers keep their plain-torch
paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-Wno-psabi"]
# name -> (the CPU flags it needs, as /proc/cpuinfo spells them; its compiler flags),
# from the oldest to the newest: isa() takes the last one the CPU has
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("avx2", "fma", "f16c", "bmi2"), ("-march=x86-64-v3",)),
    "avx512": (
        ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"),
        ("-march=x86-64-v4",),
    ),
    "amx": (
        ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"),
        ("-march=sapphirerapids",),
    ),
}
ENV = "PDSERVE_CPU_ISA"
_HERE = Path(__file__).parent
SOURCES = (
    _HERE / "cpu_ops.c",
    _HERE / "cpu_gemm.c",
    _HERE / "amx_gemm.c",
    _HERE / "attention" / "cpu_decode.c",
    _HERE / "attention" / "cpu_prefill.c",
    _HERE / "attention" / "cpu_latent.c",
    _HERE / "cpu_layer.c",
)
HEADERS = (_HERE / "cpu_vec.h", _HERE / "cpu_kernels.h")


def _cache_dir() -> Path:
    """$PDSERVE_KERNEL_CACHE, else ~/.cache/pdserve/kernels, else (not writable) a
    folder in the temporary directory."""
    if "PDSERVE_KERNEL_CACHE" in os.environ:
        return Path(os.environ["PDSERVE_KERNEL_CACHE"])
    home = Path.home() / ".cache" / "pdserve" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"pdserve-kernels-{os.getuid()}"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (empty where it does not)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def supported() -> list[str]:
    """The ISAs of ``ISAS`` this CPU has, oldest first (none off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    return [name for name, (needs, _) in ISAS.items() if flags.issuperset(needs)]


def missing(name: str) -> list[str]:
    """The CPU flags ``name`` needs that this CPU lacks (why its tests skip)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    return sorted(set(ISAS[name][0]) - cpu_flags())


def isa() -> str | None:
    """The ISA the kernels run with: ``$PDSERVE_CPU_ISA`` when set, else the newest this
    CPU has; None where it has none of them (the plain-torch paths run)."""
    have = supported()
    forced = os.environ.get(ENV)
    if forced:
        if forced not in ISAS:
            raise ValueError(f"{ENV}={forced!r}: must be one of {', '.join(ISAS)}")
        if forced not in have:
            raise ValueError(
                f"{ENV}={forced!r}: this CPU lacks {', '.join(missing(forced))}; "
                f"it runs {', '.join(have) or 'none of ' + ', '.join(ISAS)}"
            )
        return forced
    return have[-1] if have else None


def build(name: str, sources: tuple[Path, ...] = SOURCES, cache: Path | None = None) -> Path:
    """The library of ISA ``name`` compiled from ``sources`` (built now unless cached);
    raises on failure."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"no C compiler: {cc!r} is not on PATH")
    flags = [*FLAGS, *ISAS[name][1], "-mtune=native"]
    text = b"".join(p.read_bytes() for p in (*sources, *HEADERS))
    cpu = " ".join(sorted(cpu_flags())) or platform.processor()
    key = hashlib.sha256(text + " ".join([cc, *flags, platform.machine(), cpu]).encode())
    cache = cache or _cache_dir()
    target = cache / f"pdserve-cpu-{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent builders never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, f"-I{_HERE}", *map(str, sources), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=180,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    import torch  # noqa: F401  (loads libgomp before the library needs it)

    try:
        lib = ctypes.CDLL(str(build(name)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("C kernels (%s) unavailable, using plain torch: %s %s", name, e, detail)
        return None
    lib.kernels_isa.restype = ctypes.c_char_p
    built = lib.kernels_isa().decode()
    if built != name:
        raise RuntimeError(f"the {name} kernels were compiled for {built}: check {ISAS[name][1]}")
    log.info("C kernels: %s (this CPU has %s)", name, ", ".join(supported()))
    return lib


def library(name: str | None = None) -> ctypes.CDLL | None:
    """The loaded kernels of ISA ``name`` (default ``isa()``), or None (warned once) when
    they cannot be built or the CPU has no ISA of ``ISAS``."""
    name = name or isa()
    return None if name is None else _load(name)


T = TypeVar("T")


def per_isa(bind: Callable[[ctypes.CDLL], T | None]) -> Callable[[], T | None]:
    """``bind(library)`` once per ISA: the function returned gives what ``bind`` made of
    the library of the ISA in use now (``isa()``), or None where there is none."""
    made: dict[str, T | None] = {}

    @functools.wraps(bind)
    def get() -> T | None:
        name = isa()
        if name is None:
            return None
        if name not in made:
            lib = _load(name)
            made[name] = None if lib is None else bind(lib)
        return made[name]

    return get
