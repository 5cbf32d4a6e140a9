"""The router's layering: the core knows no wire format, the two front ends do not know
each other, no router module imports one that imports it back (imports inside
functions included), and ``RouterClient`` loads neither torch nor the engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.module_imports import imports

ROOT = Path(__file__).resolve().parents[2]
ROUTER = ROOT / "router"
GRPC = ("grpc", "google.protobuf", "pdserve.router.pdserve_pb2")  # grpc_health, the stubs included
WIRE = (*GRPC, "aiohttp")
FRONT_ENDS = ("pdserve.router.grpc_api", "pdserve.router.http_api", "pdserve.router.server")


def _graph() -> dict[str, set[str]]:
    """Router module -> everything it imports (the generated stubs are not sources)."""
    files = [p for p in ROUTER.glob("*.py") if "_pb2" not in p.name]
    return {
        "pdserve.router" if p.stem == "__init__" else f"pdserve.router.{p.stem}": imports(p)
        for p in files
    }


def _router_deps(graph, module: str) -> set[str]:
    return {name for name in graph[module] if name in graph and name != module}


def _closure(graph, module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for dep in _router_deps(graph, todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def _cycle(graph, module: str) -> list[str] | None:
    """A chain of imports from ``module`` back to itself, or None."""
    parent, todo = {}, [module]
    while todo:
        current = todo.pop(0)
        for dep in sorted(_router_deps(graph, current)):
            if dep == module:
                chain = [current]
                while chain[-1] != module:
                    chain.append(parent[chain[-1]])
                return [*reversed(chain), module]
            if dep not in parent:
                parent[dep] = current
                todo.append(dep)
    return None


def _fresh_modules(statement: str) -> list[str]:
    """The modules loaded by a fresh interpreter that runs ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_no_import_cycles_among_router_modules():
    graph = _graph()
    assert {
        "pdserve.router.core",
        "pdserve.router.grpc_api",
        "pdserve.router.http_api",
        "pdserve.router.server",
    } <= set(graph)
    cycles = [" -> ".join(c) for m in sorted(graph) if (c := _cycle(graph, m))]
    assert cycles == []


def test_the_core_imports_no_front_end_and_no_wire_format():
    graph = _graph()
    for module in (
        "pdserve.router.core",
        "pdserve.router.request",
        "pdserve.router.stream",
        "pdserve.router.validation",
    ):
        reached = {module} | _closure(graph, module)
        assert not reached & set(FRONT_ENDS), (module, reached)
        wire = {n for m in reached for n in graph[m] if n.startswith(WIRE)}
        assert not wire, f"{module} reaches {sorted(wire)}"
    loaded = _fresh_modules("import pdserve.router.core")
    assert not [m for m in loaded if m.startswith(WIRE)]


def test_the_front_ends_do_not_import_each_other():
    graph = _graph()
    assert "pdserve.router.http_api" not in _closure(graph, "pdserve.router.grpc_api")
    http = {"pdserve.router.http_api"} | _closure(graph, "pdserve.router.http_api")
    assert "pdserve.router.grpc_api" not in http
    assert not {n for m in http for n in graph[m] if n.startswith(GRPC)}


def test_router_client_loads_neither_torch_nor_the_engine():
    loaded = _fresh_modules("from pdserve.router.client import RouterClient")
    assert "pdserve.router.client" in loaded
    assert [m for m in loaded if m.split(".")[0] == "torch" or m.startswith("pdserve.engine")] == []
