"""Shared fixtures: tiny random Llama models saved as HF folders, the embedded model, and
each CPU kernel ISA in turn."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors in the interpreter; it must be on before they load.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.engine import native  # noqa: E402
from tests.family_models import save_tiny_family  # noqa: E402
from tests.tiny_models import (  # noqa: E402
    TINY_MLA_SHAPES,
    TINY_SHAPES,
    save_tiny_deepseek,
    save_tiny_llama,
)

torch.set_num_threads(2)


@pytest.fixture(params=list(native.ISAS))
def isa(request, monkeypatch):
    """Each ISA of engine/native.py in turn (avx2, avx512, amx), forced through
    PDSERVE_CPU_ISA for the test; skipped, with the CPU flags it lacks, where the CPU
    does not have it, and where there is no C compiler (a build that fails is an error,
    not a skip). A test that asks for it (or a module whose ``pytestmark`` uses it) so
    checks every path this CPU runs."""
    name = request.param
    if name not in native.supported():
        pytest.skip(f"{name} kernels: this CPU lacks {', '.join(native.missing(name))}")
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip(f"{name} kernels: no C compiler to build them")
    native.build(name)  # with a compiler, a source that does not build fails the test
    monkeypatch.setenv(native.ENV, name)
    return name


# Test files that start other processes (a Ray cluster, a router, gloo or gRPC peers, a
# CLI) or load HF transformers' models as the logits oracle: marked ``heavy``, which
# ``make test-fast`` (-m "not heavy") leaves out. Every file of tests/cluster/ is heavy.
HEAVY = {
    "tests/bench": ["test_peers", "test_ray_calls", "test_router_replicas",
                    "test_served_step", "test_serving_overhead"],
    "tests/kv_transfer": ["test_closed", "test_handoff", "test_integrity"],
    "tests/loadgen": ["test_compare", "test_endpoint", "test_multiturn", "test_runner",
                      "test_trace_bench"],
    "tests/planner": ["test_served"],
    "tests/router": ["test_admission", "test_cancellation", "test_front_ends", "test_fuzz",
                     "test_http_api", "test_imports", "test_logprobs", "test_openai_api",
                     "test_router_limits", "test_router_security", "test_slow_clients",
                     "test_streaming", "test_structured_api", "test_tools_api"],
    "tests": ["test_cli", "test_hf_parity", "test_packaging", "test_resume", "test_resume_workers",
              "test_speculative_sampling", "test_tensor_parallel"],
}  # fmt: skip
_HEAVY_FILES = {f"{d}/{name}.py" for d, names in HEAVY.items() for name in names}


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        if path.startswith("tests/cluster/") or path in _HEAVY_FILES:
            item.add_marker(pytest.mark.heavy)
    # the long files first (xdist hands out whole files in this order): the short ones
    # fill the workers' gaps at the end instead of a cluster file starting last
    items.sort(key=lambda item: "heavy" not in item.keywords)
    if os.environ.get("PDSERVE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set PDSERVE_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A factory: tiny_model("gqa3") -> path of a saved random HF Llama folder."""
    made: dict[str, str] = {}

    def get(name: str = "gqa2") -> str:
        if name not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{name}")
            save_tiny_llama(folder, **TINY_SHAPES[name])
            made[name] = str(folder)
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_mla_model(tmp_path_factory):
    """A factory: tiny_mla_model("v3") -> path of a saved random HF DeepSeek folder (MLA)."""
    made: dict[str, str] = {}

    def get(name: str = "v3") -> str:
        if name not in made:
            folder = tmp_path_factory.mktemp(f"tiny-mla-{name}")
            save_tiny_deepseek(folder, **TINY_MLA_SHAPES[name])
            made[name] = str(folder)
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_family_model(tmp_path_factory):
    """A factory: tiny_family_model("qwen3") -> path of a saved random HF folder of that
    family (tests/family_models.py)."""
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{name}")
            save_tiny_family(folder, name)
            made[name] = str(folder)
        return made[name]

    return get


@pytest.fixture(scope="session")
def smollm2_folder() -> str:
    """The embedded SmolLM2 converted to a HF folder (cached on disk after the first run)."""
    from pdserve.engine.checkpoint import resolve

    return str(resolve("smollm2-135m"))
