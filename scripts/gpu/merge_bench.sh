#!/usr/bin/env bash
# prequant merge on the GPU machine in one command (issue 49), within PREQUANT_DEADLINE (default 470 s), JSON under $OUT:
#   OUT=/some/dir bash scripts/gpu/merge_bench.sh      # from the repository root
# Steps, each under its own timeout (cut to the time left):
#   merge16/merge4  bench/merge.py: a 16 GB Llama-shaped base and a rank-64 adapter on every linear layer; the base
#                   converted to NF4; merged into the 16-bit base and into the 4-bit one on cuda, each from a cold
#                   page cache, against the disk's floor (read base + adapter, write the result); float32 products
#                   on the GPU against the CPU's (--agreement)
#   gpu-tests       the merge tests marked gpu (bitsandbytes' CUDA dequantization against prequant's CPU one)
# Disk: the 16 GB base, its 5.6 GB conversion, one 16 GB output at a time.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_TELEMETRY=1
export PYTHONPYCACHEPREFIX=/tmp/pycache   # the GPU image keeps no bytecode between processes
unset PYTHONDONTWRITEBYTECODE
OUT=${OUT:-/tmp/prequant-gpu-out}
WORK=${PREQUANT_WORK:-/tmp/prequant-bench}
DEADLINE=${PREQUANT_DEADLINE:-470}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/merge-log.txt") 2>&1
TEE_PID=$!
START=$(date +%s)
FAILED=()
# shellcheck source=scripts/gpu/gpu_steps.sh
source "$(dirname "$0")/gpu_steps.sh"  # step, install_wheels, report_machine, finish
trap finish EXIT
python3 -c "import bitsandbytes" 2>/dev/null || install_wheels /tmp/site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
report_machine

step merge 380 python3 scripts/bench/merge.py --size-gb 16 --shape llama --device cuda --rank 64 --agreement \
  --dir "$WORK" --json "$OUT/bench-merge.json"
step gpu-tests 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/merging
rm -rf "$WORK"/*gb "$WORK"/adapter-r* "$WORK"/base-nf4 "$WORK"/out-*
