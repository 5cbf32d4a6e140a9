"""The product does not import the benchmarks: no module of the installed packages but
bench/ itself imports bench/ (imports inside functions included); and loadgen/, which the
planner and the benchmarks share, imports neither of them; rendezvous/ and kernels/
import nothing of ours; engine/ (the model runtime) imports none of the serving folders;
kv_transfer/ (the transport library) imports neither the engine nor the serving instance."""

from __future__ import annotations

from pathlib import Path

from tests.module_imports import imports

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "instance", "kernels", "cluster", "router", "prefill_worker", "decode_worker",
           "kv_transfer", "rendezvous", "planner", "loadgen")  # fmt: skip


def _crossings(packages: tuple[str, ...], into: tuple[str, ...]) -> set[tuple[str, str]]:
    """(file, module) for each import, by a module of ``packages``, of one of ``into``."""
    found = set()
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            for name in imports(path):
                if name.removeprefix("pdserve.").split(".")[0] in into:
                    found.add((path.relative_to(ROOT).as_posix(), name))
    return found


def test_the_product_does_not_import_the_benchmarks():
    assert _crossings(PRODUCT, ("bench",)) == set()


def test_loadgen_imports_neither_the_planner_nor_the_benchmarks():
    assert _crossings(("loadgen",), ("planner", "bench")) == set()


def test_the_rendezvous_and_the_kernels_import_nothing_of_ours():
    for package in ("rendezvous", "kernels"):
        others = tuple(p for p in (*PRODUCT, "bench") if p != package)
        assert _crossings((package,), others) == set(), package


def test_the_engine_imports_none_of_the_serving_folders():
    serving = ("instance", "router", "cluster", "prefill_worker", "decode_worker", "kv_transfer")
    assert _crossings(("engine",), serving) == set()


def test_the_transport_imports_neither_the_engine_nor_the_instance():
    others = ("engine", "instance", "router", "cluster", "prefill_worker", "decode_worker")
    assert _crossings(("kv_transfer",), others) == set()
