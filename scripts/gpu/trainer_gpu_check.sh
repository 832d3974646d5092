#!/usr/bin/env bash
# Issue 16 on the GPU machine, in one run of under 10 minutes (it stops itself at 9): make an 8B-shaped random Llama
# (16 GB bf16) and convert it with prequant on the GPU; then
#   1. world size 1 on the GPU: `scripts/bench/check_fsdp.py --nproc 1 --steps 20` with transformers' own FSDP-QLoRA path,
#      load_for_fsdp and load_for_fsdp trained by TRL's SFTTrainer (`--loader trainer`), side by side: peak GPU
#      memory for load and training, RssAnon/RssFile, the 20 losses;
#   2. 8 gloo ranks on the machine's CPU (CUDA hidden): `check_fsdp.py --loader trainer --nproc 8`, 2 steps of 16 tokens,
#      per-rank RssFile/RssAnon and the bytes of the checkpoint each rank's shards hold.
#
#   bash scripts/gpu/train_wheels.sh                     # where PyPI is reachable: ./.whl with TRL, datasets, pyarrow...
#   OUT=/some/dir bash scripts/gpu/trainer_gpu_check.sh   # on the GPU machine, from the repository root, .whl carried
#
# The wheels in .whl (bitsandbytes' too) are installed into a directory named site-packages, first on PYTHONPATH:
# datasets fingerprints with dill, and dill pickles by value any module that is neither under the interpreter's
# prefix nor in a "site-packages" directory, which pyarrow's module cannot be (`Dataset.from_dict` would fail).
# Files in $OUT: log.txt (everything), check-fsdp-gpu.json, check-fsdp-cpu8.json, summary.md.
set -euo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export PYTHONPYCACHEPREFIX=/tmp/pycache   # the GPU image keeps no bytecode between processes
unset PYTHONDONTWRITEBYTECODE
OUT=${OUT:-/tmp/prequant-trainer-out}
WORK=${PREQUANT_WORK:-/tmp/prequant-fsdp}      # the same checkpoint as scripts/gpu/fsdp_gpu_check.sh
SITE=${PREQUANT_SITE:-/tmp/prequant-train/site-packages}
DEADLINE=${PREQUANT_DEADLINE:-540}             # seconds from start: the device tool kills a command at 600
SIZE_GB=${PREQUANT_SIZE_GB:-16}
SHAPE=${PREQUANT_SHAPE:-llama}                 # for a smoke test without GPUs: uniform, 0.3 GB, DEVICE=cpu, 2 ranks
DEVICE=${PREQUANT_DEVICE:-cuda}
GPU_STEPS=${PREQUANT_GPU_STEPS:-20}
GPU_ARGS=${PREQUANT_GPU_ARGS:-}                # more check_fsdp.py options for the one-GPU run (e.g. --seq-len 32)
CPU_RANKS=${PREQUANT_CPU_RANKS:-8}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE_PID=$!
SRC=$WORK/$SHAPE-${SIZE_GB}gb-bf16
CKPT=$WORK/$SHAPE-${SIZE_GB}gb-nf4
START=$(date +%s)
FAILED=()

# shellcheck source=scripts/gpu/gpu_steps.sh
source "$(dirname "$0")/gpu_steps.sh"  # left, step, install_wheels, summary, finish

trap finish EXIT

install_wheels "$SITE"

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
nproc; free -g | head -2; df -h "$WORK" | tail -1
step env 90 python3 -c "import sys, torch, transformers, peft, accelerate, bitsandbytes, trl, datasets, pyarrow
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())
for m in (transformers, peft, accelerate, bitsandbytes, trl, datasets, pyarrow): print(m.__name__, m.__version__, m.__file__)"

if [ ! -f "$SRC/config.json" ]; then
  step generate 180 python3 scripts/bench/synthetic.py "$SRC" --shape "$SHAPE" --size-gb "$SIZE_GB"
fi
[ -f "$SRC/config.json" ] || { echo "no source checkpoint: stopping"; exit 1; }
if [ ! -f "$CKPT/prequant.json" ]; then
  step convert 150 python3 -m prequant convert "$SRC" "$CKPT" --device "$DEVICE" --overwrite --no-stats
fi
[ -f "$CKPT/config.json" ] || { echo "no converted checkpoint: stopping"; exit 1; }
du -sh "$CKPT"

# 1. One GPU: transformers' path, load_for_fsdp with the plain loop, load_for_fsdp with SFTTrainer. What is left after
# it goes to the CPU run, which needs a few minutes: this one gets at most 260 s, each loader 80 s (check_fsdp.py records
# a loader that runs out of time and goes on with the next; the report is written once all have run).
step check-fsdp-gpu 260 python3 scripts/bench/check_fsdp.py "$CKPT" --nproc 1 --steps "$GPU_STEPS" --timeout 80 \
  --loader transformers --loader prequant --loader trainer --report "$OUT/check-fsdp-gpu.json" $GPU_ARGS

# 2. The machine's CPU, CUDA hidden: 8 gloo ranks, the trainer loader, 2 short steps (CPU 4-bit matmuls are slow).
CPU_LIMIT=$(( $(left) - 45 ))
THREADS=$(( $(nproc) / CPU_RANKS > 0 ? $(nproc) / CPU_RANKS : 1 ))   # torchrun would give each rank one
step check-fsdp-cpu8 "$CPU_LIMIT" env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=$THREADS python3 scripts/bench/check_fsdp.py "$CKPT" --nproc "$CPU_RANKS" \
  --loader trainer --steps 2 --seq-len 16 --batch-size 1 --timeout $((CPU_LIMIT - 15)) --report "$OUT/check-fsdp-cpu8.json"

summary trainer
