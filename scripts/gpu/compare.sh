#!/usr/bin/env bash
# This tree against an earlier one (BEFORE=DIR, a copy of that checkout: `git archive REV | tar -x -C DIR`) on the
# same generated checkpoints in one GPU call: the 33 GB Grok-shaped repo from the local Hub endpoint, then the 16 GB
# Llama with libraries warm on cuda and cpu. Each tree runs its own benchmark scripts (which put it first on
# PYTHONPATH), against its own floor measured beside it.
#   OUT=/some/dir BEFORE=.before bash scripts/gpu/compare.sh          # from the repository root, wheels carried
# STEPS picks parts: "hub llama gpu-tests startup cpu qwen3 merge" (default the first five, in that order; qwen3: the
# 16-layer Qwen3-30B-A3B shape with --quantize-experts, merge: a rank-64 adapter into the 16 GB Llama, both bases).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_TELEMETRY=1
export PYTHONPYCACHEPREFIX=/tmp/pycache
OUT=${OUT:-/tmp/prequant-compare}; WORK=${PREQUANT_WORK:-/tmp/prequant-bench}; BEFORE=$(realpath "${BEFORE:?BEFORE=DIR}")
STEPS=${STEPS:-hub llama gpu-tests startup cpu}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
python3 -c "import bitsandbytes" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader; nproc; date -u
NEW=$PWD
both() {  # both NAME ARGS...: the bench in BEFORE's tree, then in this tree
  local name=$1; shift
  for side in before after; do
    local tree=$NEW; [ $side = before ] && tree=$BEFORE
    echo "== $name, $side"
    (cd "$tree/scripts/bench" && python3 "$@" --dir "$WORK" --json "$OUT/$name-$side.json")
  done
}
if [[ " $STEPS " == *" hub "* ]]; then
  both hub33 hub_scale.py --shape grok --size-gb 33 --device cuda --repeats 2 --skip-download
  rm -rf "$WORK"/grok-* "$WORK"/hub-* "$WORK"/out-*
fi
if [[ " $STEPS " == *" llama "* ]]; then
  both llama16 window.py --size-gb 16 --shape llama --devices cuda --windows 0 --warm-libraries --repeats 2
fi
if [[ " $STEPS " == *" gpu-tests "* ]]; then  # this tree's GPU tests
  PYTHONPATH=$NEW:/tmp/site python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tail -15 | tee "$OUT/gpu-tests.txt"
fi
if [[ " $STEPS " == *" startup "* ]]; then  # a tiny checkpoint's whole process, both trees, interleaved
  (cd scripts/bench && python3 startup.py --repeats 3 --device auto --skip 'head start' --before "$BEFORE" \
    --json "$OUT/startup.json")
fi
if [[ " $STEPS " == *" cpu "* ]]; then
  both llama16cpu window.py --size-gb 16 --shape llama --devices cpu --windows 2 --warm-libraries --repeats 1
fi
if [[ " $STEPS " == *" qwen3 "* ]]; then
  both qwen3 convert.py --shape qwen3_moe --layers 16 --device cuda --warm-libraries --prequant-arg=--quantize-experts
  rm -rf "$WORK"/qwen3_moe-*
fi
if [[ " $STEPS " == *" merge "* ]]; then
  both merge16 merge.py --size-gb 16 --shape llama --device cuda --rank 64
fi
rm -rf "$WORK"/llama-* "$WORK"/adapter-*
date -u
