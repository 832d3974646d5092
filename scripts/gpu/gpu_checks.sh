#!/usr/bin/env bash
# The GPU machine's measurement set (issue 17) in one command, within PREQUANT_BUDGET_S (default 560 s), JSON
# results under $OUT, then one table of every figure (scripts/bench/summary.py) and the GPU tests if time is left:
#   OUT=/some/dir bash scripts/gpu/gpu_checks.sh      # from the repository root
#   PREQUANT_STEPS="gpu-tests startup" ... runs only those steps, in the order below (default: all of them).
#   One call of 10 minutes holds "llama16 startup gpu-tests" (about 300 s) or "grok33" alone (its generation,
#   floor, three conversions and the Hub path outran 300 s on 2026-12-02), not both.
# Steps, each under its own timeout (cut to the time left) and each going on after a failed one:
#   cpu-kernel   bench/cpu_kernel.py, 14336x4096, threads 1,2,4,8,16, beside bitsandbytes' CPU path
#   llama16      bench/convert.py 16 GB Llama: cuda with libraries warm, and --device cpu (--also-device), one floor
#   grok33       bench/convert.py Grok shapes (3 layers, 32.7 GB), everything cold: cuda, then torch capped at 8 GiB,
#                then from the local Hub server with --delete-source-shards (download alone measured beside it)
#   startup      a tiny checkpoint's whole conversion and --dry-run, libraries warm, beside a baseline
#                (bench/startup.py), with --device auto: what a user who names no device gets
#   gpu-tests    every test marked gpu (bitsandbytes' kernel as the reference, FSDP on NCCL, ...)
# Disk (64 GB): one checkpoint at a time (16 GB, then 33 GB); outputs are deleted once hashed; the Hub path
# holds the 33 GB source (served by hard links), at most 2 downloaded shards and the 11 GB output.
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
BUDGET=${PREQUANT_BUDGET_S:-560}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_TELEMETRY=1
# The GPU image keeps no bytecode between processes; an installed package has it. Cache it once, for every path.
export PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
OUT=${OUT:-/tmp/prequant-gpu-out}
WORK=${PREQUANT_WORK:-/tmp/prequant-bench}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
if ! python3 -c "import bitsandbytes" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | sed -n 2p; df -h "$WORK" | tail -1
python3 -c "import torch, transformers, bitsandbytes; print('torch', torch.__version__, 'transformers', transformers.__version__, 'bnb', bitsandbytes.__version__)"
python3 -c "import prequant.conversion.run, prequant.bnb.quantize, prequant.bnb.kernels.cpu, bitsandbytes.functional, transformers, huggingface_hub, pytest; from transformers import LlamaForCausalLM, AutoModelForCausalLM, BitsAndBytesConfig"

STATUS=()
STEPS=${PREQUANT_STEPS:-cpu-kernel llama16 grok33 startup gpu-tests}
step() {  # step NAME SECONDS COMMAND...: run under min(SECONDS, time left), record how it ended
  local name=$1 limit=$2; shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  local left=$(( BUDGET - ($(date +%s) - START) ))
  (( limit > left )) && limit=$left
  if (( limit < 15 )); then STATUS+=("$name: skipped (no time left)"); echo "== $name skipped"; return; fi
  echo "== $name (limit ${limit}s, $(( $(date +%s) - START ))s elapsed)"
  local t0=$(date +%s)
  # Its own process group, so that running out of time also ends the conversions a bench started.
  setsid "$@" &
  local pid=$!
  ( sleep "$limit"; echo "== $name: out of time"; kill -TERM -- "-$pid" 2>/dev/null; sleep 10; kill -KILL -- "-$pid" 2>/dev/null ) &
  local watchdog=$!
  wait "$pid"
  local rc=$?
  kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
  STATUS+=("$name: rc $rc in $(( $(date +%s) - t0 ))s")
}
clear_checkpoints_except() {  # one generated checkpoint on disk at a time
  ls -d "$WORK"/*gb 2>/dev/null | grep -vx "$WORK/$1" | xargs -r rm -rf
}

step cpu-kernel 120 sh -c "python3 scripts/bench/cpu_kernel.py --shapes 14336x4096 --repeats 2 --threads 1,2,4,8,16 --json > '$OUT/cpu_kernel.json'"
clear_checkpoints_except llama-16gb
step llama16 170 python3 scripts/bench/convert.py --size-gb 16 --shape llama --device cuda --also-device cpu --warm-libraries \
  --dir "$WORK" --json "$OUT/bench-llama16.json"
clear_checkpoints_except grok-33gb
step grok33 420 python3 scripts/bench/convert.py --size-gb 33 --shape grok --device cuda --memory-limit-gib 8 --hub \
  --dir "$WORK" --json "$OUT/bench-grok33.json"
clear_checkpoints_except none
# Best of 3 whole processes, and --dry-run.
step startup 130 python3 scripts/bench/startup.py --repeats 3 --device auto --skip 'head start' \
  --json "$OUT/startup.json"
python3 scripts/bench/summary.py "$OUT"
clear_checkpoints_except none
step gpu-tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ ${PREQUANT_TESTS:+-k "$PREQUANT_TESTS"}
rm -rf "$WORK"/*gb
printf '%s\n' "${STATUS[@]}" | tee "$OUT/steps.txt"
echo "total $(( $(date +%s) - START ))s"
