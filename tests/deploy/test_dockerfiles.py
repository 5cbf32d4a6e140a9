"""deploy/docker: the CPU and CUDA image recipes, checked for what can be checked
without building them: every COPY source exists and every package pyproject installs
is copied; the install is scripts/setup.sh's (which honours ``PDSERVE_TORCH_INDEX``)
with torch's pinned version from the CPU or a CUDA index; the base image is pinned;
Ray's dashboard extra is the project's Ray; the two files differ only in the variant;
the build context leaves out local environments and generated stubs."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.deploy.manifests import DEPLOY, ROOT

DOCKER = DEPLOY / "docker"
FILES = {"cpu": DOCKER / "Dockerfile", "cuda": DOCKER / "Dockerfile.cuda"}
COVERS = tuple(
    f"docker/{name}{ignore}"
    for name in ("Dockerfile", "Dockerfile.cuda")
    for ignore in ("", ".dockerignore")
)
TORCH_INDEX = {
    "cpu": r"https://download\.pytorch\.org/whl/cpu",
    "cuda": r"https://download\.pytorch\.org/whl/cu\d+",
}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments out."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("variant", FILES)
def test_copy_sources_exist_and_cover_the_packages(variant):
    copied = set()
    for word, args in instructions(FILES[variant].read_text()):
        if word == "COPY":
            *sources, _target = args.split()
            for source in sources:
                assert not source.startswith("--"), f"COPY {source}: no flags expected"
                assert (ROOT / source).exists(), f"COPY {source}: no such file in the repo"
                copied.add(source.rstrip("/"))
    assert pyproject()["tool"]["setuptools"]["packages"]["find"]["include"] == ["pdserve*"]
    assert "pdserve" in copied, "pdserve/ (the namespace's links) is not copied"
    for link in (ROOT / "pdserve").iterdir():  # each a link to a top-level folder
        if link.is_symlink():
            assert link.name in copied, f"package pdserve.{link.name} ({link.name}/) is not copied"
    for needed in ("pyproject.toml", "setup.py", "README.md", "scripts"):
        assert needed in copied


@pytest.mark.parametrize("variant", FILES)
def test_installs_as_the_readme_does(variant):
    steps = instructions(FILES[variant].read_text())
    base = next(args for word, args in steps if word == "FROM")
    assert re.fullmatch(r"python:3\.1[1-9]\.\d+-[a-z-]+", base), f"unpinned base image {base}"
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG")
    assert re.fullmatch(TORCH_INDEX[variant], args["PDSERVE_TORCH_INDEX"])
    run = " ".join(a for w, a in steps if w == "RUN")
    assert 'PDSERVE_TORCH_INDEX="$PDSERVE_TORCH_INDEX" bash scripts/setup.sh' in run
    ray_pin = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("ray=="))
    assert f'"ray[default]=={ray_pin.partition("==")[2]}"' in run
    env = " ".join(a for w, a in steps if w == "ENV")
    assert "PATH=/opt/pdserve/.venv/bin:" in env


def test_setup_sh_pins_torch_and_takes_the_index():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pinned = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch=="))
    line = next(line for line in setup.splitlines() if line.startswith("pip install torch"))
    assert line.split()[2] == pinned
    assert '${PDSERVE_TORCH_INDEX:+--index-url "$PDSERVE_TORCH_INDEX"}' in line


def test_the_variants_differ_only_in_the_torch_index():
    def variant_free(path):
        text = path.read_text()
        text = re.sub(r"ARG PDSERVE_TORCH_INDEX=\S+", "ARG PDSERVE_TORCH_INDEX=", text)
        return [line for line in text.splitlines() if not line.startswith("#")]

    assert variant_free(FILES["cpu"]) == variant_free(FILES["cuda"])


@pytest.mark.parametrize("variant", FILES)
def test_build_context_leaves_out_local_files(variant):
    ignore = FILES[variant].with_name(FILES[variant].name + ".dockerignore").read_text().split()
    for pattern in ("**/.venv", "**/__pycache__", "**/*_pb2.py", "**/*_pb2_grpc.py", ".git"):
        assert pattern in ignore
