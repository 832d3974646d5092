#!/usr/bin/env bash
# The GPU-machine run behind the README's figures: GPU tests (bitsandbytes' CUDA kernel as the reference),
# then scripts/bench.py on ~4, ~16 (with transformers' path beside it, libraries warm and cold, and with 1 GB output
# shards) and ~30 GB synthetic checkpoints.
#   OUT=/some/dir bash scripts/gpu_checks.sh      # from the repository root, prequant importable
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# The GPU image keeps no bytecode between processes; a normal install has it. Cache it once, for both paths.
export PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
python3 -c "import prequant.conversion.run, prequant.bnb.quantize, bitsandbytes.functional, transformers; from transformers import LlamaForCausalLM, AutoModelForCausalLM, BitsAndBytesConfig"
OUT=${OUT:-/tmp/prequant-gpu-out}
WORK=${PREQUANT_WORK:-/tmp/prequant-bench}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | sed -n 2p; df -h "$WORK" | tail -1
python3 -c "import torch, transformers, bitsandbytes; print('torch', torch.__version__, 'transformers', transformers.__version__, 'bnb', bitsandbytes.__version__)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/conversion/test_convert_gpu.py tests/bnb/test_quantize_gpu.py tests/conversion/test_grok.py ${PREQUANT_TESTS:+-k "$PREQUANT_TESTS"} 2>&1 | tail -25
IFS=';' read -ra SPECS <<< "${PREQUANT_BENCH:-16 llama --transformers --warm-libraries;16 llama;16 llama --warm-libraries --prequant-arg=--max-shard-size=1GB;4 llama --warm-libraries;30 llama --warm-libraries}"
for spec in "${SPECS[@]}"; do
  set -- $spec
  # One checkpoint on disk at a time (the machine's disk is 64 GB); consecutive specs of one size share it.
  ls -d "$WORK"/*gb 2>/dev/null | grep -vx "$WORK/$2-$1gb" | xargs -r rm -rf   # bench.py names them SHAPE-SIZEgb
  timeout 240 python3 scripts/bench.py --size-gb "$1" --shape "$2" "${@:3}" --device cuda --dir "$WORK" \
    --json "$OUT/bench-$1gb$(echo "${@:3}" | sed 's/--//g; s/[ =]/_/g').json" > /dev/null
done
rm -rf "$WORK"/*gb
