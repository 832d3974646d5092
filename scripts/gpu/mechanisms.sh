#!/usr/bin/env bash
# Each speed mechanism with and without it, in one GPU call (issue 45): the same generated checkpoints, runs
# interleaved, one floor each. Run from the repository root with the bitsandbytes wheel carried:
#   OUT=/some/dir bash scripts/gpu/mechanisms.sh            # about 8 minutes on the H100 machine
# BEFORE=DIR measures the prequant in DIR (a checkout) instead of this tree (bench scripts stay this tree's).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_TELEMETRY=1
export PYTHONPYCACHEPREFIX=/tmp/pycache
OUT=${OUT:-/tmp/prequant-mech}; WORK=${PREQUANT_WORK:-/tmp/prequant-bench}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
python3 -c "import bitsandbytes" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader; nproc; date -u
cd scripts/bench
# 33 GB Grok shapes from the local Hub endpoint: prequant's own transfer in a child process against
# huggingface_hub's hf_hub_download on threads; shards freed as converted against freed whole
python3 hub_scale.py --shape grok --size-gb 33 --device cuda --repeats 2 --skip-download \
  --variant PREQUANT_HUB_CLIENT=huggingface_hub --variant PREQUANT_HUB_FREE_AS_CONVERTED=0 \
  --variant PREQUANT_HUB_CLIENT=huggingface_hub \
  --dir "$WORK" --json "$OUT/hub33.json"
rm -rf "$WORK"/grok-* "$WORK"/hub-* "$WORK"/out-*
# 16 GB Llama, libraries warm: the layout settled from names (0) against a head start on the prediction while
# transformers confirms it in a child process (1), then waiting for transformers' layout in a run of its own
python3 window.py --size-gb 16 --shape llama --devices cuda --windows 0 --warm-libraries \
  --env PREQUANT_CONFIRM_LAYOUT=0,1 --repeats 2 --dir "$WORK" --json "$OUT/llama16-headstart.json"
python3 window.py --size-gb 16 --shape llama --devices cuda --windows 0 --warm-libraries \
  --env PREQUANT_PREDICT_LAYOUT=0 --repeats 2 --dir "$WORK" --json "$OUT/llama16-wait.json"
# the same on the CPU: worker processes against the kernel's threads in this process
python3 window.py --size-gb 16 --shape llama --devices cpu --windows 2 --warm-libraries \
  --env PREQUANT_CPU_WORKERS=auto,0 --repeats 1 --dir "$WORK" --json "$OUT/llama16-workers.json"
rm -rf "$WORK"/llama-*
date -u
