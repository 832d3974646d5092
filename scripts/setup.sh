#!/usr/bin/env bash
# Create .venv with prequant and its test dependencies. torch is pinned to the CPU build that this
# project's machines carry on disk; on a GPU machine, install your CUDA torch first and drop the pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" -e '.[test]'
