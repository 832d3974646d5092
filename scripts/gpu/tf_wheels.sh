#!/usr/bin/env bash
# The wheels that `prequant.load_model`'s GPU tests need beyond the GPU image (whose transformers is older than the
# 5.25 load_model is tested with): transformers 5.25 with the huggingface_hub, tokenizers, safetensors and HTTP
# client releases it needs, for CPython 3.12 on x86-64 Linux, into ./.whl-tf (git-excluded). Not `kernels`: with
# it installed, transformers asks the Hub for its kernels while building a model, which fails offline; without it,
# transformers 5.25 refuses its default use_kernels=True on CUDA unless USE_HUB_KERNELS=0 turns kernels off. Run it where
# PyPI is reachable, then on the GPU machine (carry [".whl", ".whl-tf"]):
#
#   bash scripts/gpu/tf_wheels.sh
#   python3 -m pip install -q --no-index --no-deps --target /tmp/tf .whl-tf/*.whl
#   USE_HUB_KERNELS=0 PYTHONPATH=$PWD:/tmp/tf:/tmp/site python3 -m pytest -q -m gpu tests/
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl-tf/' "$EXCLUDE" 2>/dev/null || echo '/.whl-tf/' >> "$EXCLUDE"
mkdir -p .whl-tf
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl-tf \
  transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 hf-xet==1.8.0 httpx2==2.17.0 \
  httpcore2==2.17.0 truststore==0.10.5 anyio==4.16.0
ls .whl-tf
