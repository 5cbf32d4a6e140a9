"""The project installs as one package, ``pdserve`` (docs/architecture.md, "One
namespace"): nothing else of ours lands at the top of site-packages, and HF transformers
(which imports HF's ``kernels`` distribution) works beside it, installed or run from the
repository's root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = (
    "from transformers import AutoModelForCausalLM, LlamaConfig\n"
    "cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,\n"
    "                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100)\n"
    "import torch\n"
    "print(AutoModelForCausalLM.from_config(cfg)(torch.tensor([[1, 2]])).logits.shape)\n"
)


def _python(code: str, cwd: Path, path: Path, home: Path) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(path)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(600)
def test_an_install_holds_only_pdserve_and_transformers_imports_beside_it(tmp_path):
    target = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    top = sorted(p.name for p in target.iterdir() if p.name != "bin")
    assert top[0] == "pdserve" and len(top) == 2 and top[1].startswith("pdserve-"), top
    assert top[1].endswith(".dist-info"), top
    installed = target / "pdserve"
    assert not any(p.is_symlink() for p in installed.iterdir())  # the files, not links
    assert (installed / "router" / "pdserve_pb2.py").is_file()  # the stubs, generated
    assert (installed / "engine" / "cpu_gemm.c").is_file()  # sources built on first use
    # from a folder outside the checkout, the installed copy: transformers' own `kernels`
    # and ours under pdserve side by side
    code = (
        "import pdserve.kernels.rotary, pdserve.router.client, kernels\n"
        f"assert pdserve.kernels.rotary.__file__.startswith({str(installed)!r})\n"
        "assert 'site-packages' in kernels.__file__, kernels.__file__\n" + TINY_LLAMA
    )
    assert "torch.Size([1, 2, 100])" in _python(code, tmp_path, target, tmp_path)


def test_transformers_works_from_the_repository_root(tmp_path):
    """The root is on sys.path there (``python -m``, pytest's ``pythonpath``): the
    ``kernels/`` folder must not stand in for HF's ``kernels``."""
    code = "import kernels, pdserve.kernels.rotary\nassert kernels.__file__\n" + TINY_LLAMA
    assert "torch.Size([1, 2, 100])" in _python(code, ROOT, ROOT, tmp_path)
