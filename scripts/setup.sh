#!/usr/bin/env bash
# Create a virtual environment. torch is pinned to the CPU build that this project's machines carry on disk; on a
# GPU machine, install your CUDA torch first and drop the pin.
#
#   bash scripts/setup.sh            .venv        prequant and its test dependencies, newest versions
#   bash scripts/setup.sh floor      .venv-floor  the same at exactly the lowest versions pyproject.toml declares
#                                                 (scripts/dev/floors.py); tests/ecosystem runs there in .ci/run
#   bash scripts/setup.sh tf4        .venv-tf4    a consumer of prequant's outputs on the last transformers 4.x
#                                                 (scripts/dev/consumer-tf4.txt; no prequant: it needs
#                                                 huggingface_hub < 1.0); tests/ecosystem loads outputs with it
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==${TORCH_VERSION:-2.13.0}"
case "${1:-main}" in
  main)
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "$TORCH" -e '.[test]'
    ;;
  floor)
    [ -x .venv-floor/bin/python ] || "$PY" -m venv .venv-floor
    "$PY" scripts/dev/floors.py > .venv-floor/floors.txt
    .venv-floor/bin/python -m pip install -q --upgrade pip
    # -c: every dependency exactly at its floor; pip refuses if the floors do not install together.
    .venv-floor/bin/python -m pip install -q -c .venv-floor/floors.txt -e '.[transformers,fsdp,testtools]'
    ;;
  tf4)
    [ -x .venv-tf4/bin/python ] || "$PY" -m venv .venv-tf4
    .venv-tf4/bin/python -m pip install -q --upgrade pip
    .venv-tf4/bin/python -m pip install -q -r scripts/dev/consumer-tf4.txt
    ;;
  *)
    echo "usage: bash scripts/setup.sh [main|floor|tf4]" >&2
    exit 2
    ;;
esac
