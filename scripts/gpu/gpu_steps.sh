# Sourced by the GPU machine's check scripts (trainer_gpu_check.sh, fsdp_gpu_check.sh, grok_fsdp_check.sh), after
# they set OUT, TEE_PID (the tee of their log), START (date +%s), DEADLINE (seconds from START) and FAILED=():
# steps that share one time budget, their summary, and one way to end (`trap finish EXIT`, or a finish() that calls
# finish_steps).

GPU_DIR=$(dirname "${BASH_SOURCE[0]}")

left() { echo $((DEADLINE - ($(date +%s) - START))); }

# step NAME LIMIT CMD...: run CMD under min(LIMIT, time left); log its time and status; never abort the script.
step() {
  local name=$1 limit=$2 rc=0 t0
  shift 2
  t0=$(date +%s)
  if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
  if [ "$limit" -lt 20 ]; then
    echo "=== $name: skipped, $(left)s left"
    FAILED+=("$name:skipped")
    return 0
  fi
  echo "=== $name (limit ${limit}s, at +$((t0 - START))s): $*"
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  echo "=== $name: exit $rc after $(($(date +%s) - t0))s"
  if [ "$rc" -ne 0 ]; then FAILED+=("$name:$rc"); fi
  return 0
}

# install_wheels DIR: the wheels carried in .whl (scripts/gpu/train_wheels.sh's, bitsandbytes') installed into DIR, which
# goes on PYTHONPATH after the checkout (the current directory: the repository root).
install_wheels() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" .whl/*.whl
  fi
  export PYTHONPATH=$PWD:$1${PYTHONPATH:+:$PYTHONPATH}
}

# report_machine: the GPU, cores, memory, WORK's disk and the library versions, at the head of the log.
report_machine() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  nproc; free -g | sed -n 2p; df -h "$WORK" | tail -1
  python3 -c "import torch, transformers, peft, bitsandbytes; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__)"
}

# summary KIND: $OUT/summary.md from the reports (fsdp_summary.py KIND), printed; always, however little time is
# left: it only reads them.
summary() {
  echo "=== summary"
  timeout 30 python3 "$GPU_DIR/fsdp_summary.py" "$1" "$OUT" || echo "=== summary: failed"
}

# The last lines of the log, then close it so that tee has written all of log.txt before $OUT is collected.
finish_steps() {
  echo "=== done after $(($(date +%s) - START))s; failed steps: ${FAILED[*]:-none}"
  ls -la "$OUT"
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null || true  # let tee finish log.txt before $OUT is collected
}
finish() { finish_steps; }
