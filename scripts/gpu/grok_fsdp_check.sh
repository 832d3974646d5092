#!/usr/bin/env bash
# Issue 20, the part one GPU machine can run (under 9.5 minutes; it stops itself and always writes summary.md): a
# checkpoint with Grok-1's real shapes (hidden 6144, 48 heads, 8 KV heads, 8 experts of 32768, vocab 131072) in
# keyfan/grok-1-hf naming with the remote-code model of tests/grok/, as many layers as disk allows (4 wanted),
# converted by prequant on the GPU; then 8 gloo ranks on the machine's CPU (CUDA hidden) load it with load_for_fsdp
# and train: `scripts/bench/check_fsdp.py --nproc 8 --trust-remote-code`, loaders prequant and trainer, 16 tokens a step.
#
#   OUT=/some/dir bash scripts/gpu/grok_fsdp_check.sh  # on the GPU machine, from the repository root, .whl carried
#
# Smoke test without a GPU (reduced dimensions, 2 ranks):
#   PREQUANT_DEVICE=cpu PREQUANT_CPU_RANKS=2 PREQUANT_LAYERS=2 PREQUANT_DEADLINE=1500 \
#   PREQUANT_DIMS='{"hidden": 256, "inter": 512, "vocab": 1024, "heads": 8}' OUT=/tmp/grok-smoke bash scripts/gpu/grok_fsdp_check.sh
#
# Steps: the first of PREQUANT_LOADERS ("prequant trainer") runs with PREQUANT_FIRST_STEPS (3); its measured seconds
# per step and per run then size the second loader's run (up to PREQUANT_STEPS, 10) to the time left, and, if time is
# still left, a second run of the first loader with more steps replaces its first. PREQUANT_LOADERS="trainer prequant"
# puts the trainer loader first (on 8 CPU ranks a step takes about a minute: second, it may get no time at all). transformers' own path is not run: it puts the whole model on
# every rank (8 x the checkpoint in host memory, more than the machine's RAM at 4 layers).
# The wheels in .whl go into a directory named site-packages (see scripts/gpu/trainer_gpu_check.sh for why).
# Files in $OUT: log.txt, plan.json, check-prequant.json, check-trainer.json, summary.md (scripts/gpu/fsdp_summary.py).
set -euo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export PYTHONPYCACHEPREFIX=/tmp/pycache   # the GPU image keeps no bytecode between processes
unset PYTHONDONTWRITEBYTECODE
OUT=${OUT:-/tmp/prequant-grok-out}
WORK=${PREQUANT_WORK:-/tmp/prequant-grok}
SITE=${PREQUANT_SITE:-/tmp/prequant-train/site-packages}
DEADLINE=${PREQUANT_DEADLINE:-560}             # seconds from start: the device tool kills a command at 600
DEVICE=${PREQUANT_DEVICE:-cuda}                # where convert quantizes (and the generator draws)
CPU_RANKS=${PREQUANT_CPU_RANKS:-8}
LAYERS=${PREQUANT_LAYERS:-}                    # default: 4, fewer if disk or RAM (8 training ranks) cannot hold them
DIMS=${PREQUANT_DIMS:-}                        # JSON overriding SHAPES["grok"] of scripts/bench/synthetic.py
STEPS=${PREQUANT_STEPS:-10}
FIRST_STEPS=${PREQUANT_FIRST_STEPS:-3}
read -r FIRST SECOND _ <<< "${PREQUANT_LOADERS:-prequant trainer}"
for l in $FIRST ${SECOND:-}; do
  case $l in prequant|trainer) ;; *) echo "PREQUANT_LOADERS: '$l' is neither prequant nor trainer"; exit 2;; esac
done
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE_PID=$!
START=$(date +%s)
FAILED=()

# shellcheck source=scripts/gpu/gpu_steps.sh
source "$(dirname "$0")/gpu_steps.sh"  # left, step, install_wheels, summary, finish

finish() {
  summary grok
  finish_steps
}
trap finish EXIT

install_wheels "$SITE"

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
nproc; free -g | head -2; df -h "$WORK" /dev/shm | tail -2; lscpu | grep -E "^Model name|^Flags" | cut -c1-200 || true
step env 90 python3 -c "import sys, torch, transformers, peft, accelerate, bitsandbytes, trl, datasets, pyarrow
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'cpu', torch.backends.cpu.get_cpu_capability())
for m in (transformers, peft, accelerate, bitsandbytes, trl, datasets, pyarrow): print(m.__name__, m.__version__, m.__file__)"

# The plan: layers, and where the bf16 source goes. Both checkpoints must fit at once during conversion; the source
# goes to /dev/shm (RAM, freed before the CPU ranks start) when it fits there, so the disk only holds the output.
# RAM: training on the CPU took each rank's RssAnon to about the checkpoint's size plus 1.5 GiB (the 8B Llama on 8 gloo
# ranks: 7.15 GiB for 5.6 GB, README), so without PREQUANT_LAYERS the layers are also limited to what 8 such ranks
# fit in 90% of the RAM; an out-of-memory rank would leave no report at all.
python3 - "$WORK" "$OUT/plan.json" "$LAYERS" "$DIMS" "$CPU_RANKS" <<'EOF'
import json, os, shutil, sys
sys.path.insert(0, "scripts/bench")
from synthetic import sizes
work, plan_file, want, dims = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4] or "{}")
ranks, ram = int(sys.argv[5]), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
layer, fixed = sizes("grok", dims)
nf4_layer = layer / 4 * 1.03 + 4096  # packed 4-bit (a quarter of bf16) + double-quantized absmax; kept tensors as bf16
margin = 2e9
disk = shutil.disk_usage(work).free
shm = shutil.disk_usage("/dev/shm").free
plan = None
for n in range(int(want or 4), 0, -1):
    src, nf4 = fixed + n * layer, fixed + n * nf4_layer
    if not want and ranks * (1.1 * nf4 + 2 * 2**30) > 0.9 * ram and n > 1:
        continue
    if src + margin < shm and nf4 + margin < disk:
        plan = {"layers": n, "source_in": "/dev/shm"}
    elif src + nf4 + margin < disk:
        plan = {"layers": n, "source_in": work}
    if plan:
        plan.update(source_gb=src / 1e9, nf4_gb_estimate=nf4 / 1e9, disk_free_gb=disk / 1e9, shm_free_gb=shm / 1e9,
                    ram_gb=ram / 1e9, ranks=ranks,
                    layers_wanted=int(want or 4), dims=dims)
        break
if plan is None:
    sys.exit(f"plan: not even one layer fits ({disk / 1e9:.1f} GB free on {work}, {shm / 1e9:.1f} GB in /dev/shm)")
json.dump(plan, open(plan_file, "w"), indent=2)
print("plan:", json.dumps(plan))
EOF
N=$(python3 -c "import json; print(json.load(open('$OUT/plan.json'))['layers'])")
SRC=$(python3 -c "import json; print(json.load(open('$OUT/plan.json'))['source_in'])")/prequant-grok-$N-bf16
CKPT=$WORK/grok-$N-nf4

if [ ! -f "$CKPT/prequant.json" ]; then
  rm -rf "$WORK"/grok-*-nf4 /dev/shm/prequant-grok-*-bf16 "$WORK"/prequant-grok-*-bf16   # earlier runs' leftovers
  step generate 200 python3 scripts/bench/synthetic.py "$SRC" --shape grok --layers "$N" --model-code \
    ${DIMS:+--dims "$DIMS"}
  [ -f "$SRC/config.json" ] || { echo "no source checkpoint: stopping"; exit 1; }
  step convert 240 python3 -m prequant convert "$SRC" "$CKPT" --device "$DEVICE" --trust-remote-code --no-stats --overwrite
  rm -rf "$SRC"   # the CPU ranks need the RAM (/dev/shm) or the disk
fi
[ -f "$CKPT/prequant.json" ] || { echo "no converted checkpoint: stopping"; exit 1; }
du -sh "$CKPT"; free -g | head -2

THREADS=$(( $(nproc) / CPU_RANKS > 0 ? $(nproc) / CPU_RANKS : 1 ))   # torchrun would give each rank one
check() {  # check LOADER STEPS REPORT LIMIT
  step "check-$1-$2" "$4" env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=$THREADS python3 scripts/bench/check_fsdp.py "$CKPT" \
    --nproc "$CPU_RANKS" --trust-remote-code --loader "$1" --steps "$2" --seq-len 16 --batch-size 1 \
    --timeout $(($4 - 10)) --report "$3"
}
# steps_fitting SECONDS REPORT WALL LOADER: how many steps a run of LOADER fits in SECONDS, from the first loader's
# run in REPORT, which took WALL seconds (0: none).
steps_fitting() {
  python3 - "$1" "$2" "$STEPS" "$FIRST_STEPS" "$3" "$FIRST" "$4" <<'EOF'
import json, sys
seconds, report, most, first, wall = float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
measured, sized = sys.argv[6], sys.argv[7]
# SFTTrainer's steps cost a little more than the plain loop's
factor = {("prequant", "trainer"): 1.15, ("trainer", "prequant"): 1 / 1.15}.get((measured, sized), 1.0)
try:
    r = json.load(open(report))["runs"][measured]
    step = max(x["train"]["seconds"] for x in r["ranks"]) / first
    fixed = wall - step * first + 25  # torchrun, imports (TRL: more), load, the bytes checks
    print(max(0, min(most, int((seconds - fixed) / (step * factor)))))
except (OSError, KeyError, ValueError, ZeroDivisionError):
    print(0)
EOF
}

T0=$(date +%s)
check "$FIRST" "$FIRST_STEPS" "$OUT/check-$FIRST.json" $(( $(left) - 40 ))
WALL=$(( $(date +%s) - T0 ))
[ -f "$OUT/check-$FIRST.json" ] || { echo "the first $FIRST run left no report: stopping"; exit 1; }
if [ -n "${SECOND:-}" ]; then
  N2=$(steps_fitting $(( $(left) - 40 )) "$OUT/check-$FIRST.json" "$WALL" "$SECOND")
  if [ "$N2" -ge 1 ]; then
    check "$SECOND" "$N2" "$OUT/check-$SECOND.json" $(( $(left) - 40 ))
  else
    echo "=== check-$SECOND: skipped, $(left)s left is not enough for one step"; FAILED+=("check-$SECOND:skipped")
  fi
fi
MORE=$(steps_fitting $(( $(left) - 40 )) "$OUT/check-$FIRST.json" "$WALL" "$FIRST")
if [ "$MORE" -ge $((2 * FIRST_STEPS)) ]; then  # worth a second run: it replaces the first only if it completes
  check "$FIRST" "$MORE" "$OUT/check-$FIRST-more.json" $(( $(left) - 40 ))
  if python3 -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['runs'][sys.argv[2]].get('summary') else 1)" \
      "$OUT/check-$FIRST-more.json" "$FIRST" 2>/dev/null; then
    mv "$OUT/check-$FIRST.json" "$OUT/check-$FIRST-first.json"
    mv "$OUT/check-$FIRST-more.json" "$OUT/check-$FIRST.json"
  fi
fi
