#!/usr/bin/env bash
# Issues 47 and 48 on the GPU machine in one call (it stops itself at PREQUANT_DEADLINE, 540 s; the device tool kills
# a command at 600), JSON per step and summary.md under $OUT:
#   OUT=/some/dir bash scripts/gpu/moe_fp8.sh            # from the repository root, .whl (bitsandbytes) carried
#   TINY=1 OUT=/tmp/x bash scripts/gpu/moe_fp8.sh        # the same steps at reduced dimensions on the CPU (smoke run)
#   PREQUANT_STEPS="deepseek gpu-tests" ...              # only those steps (default: all, in the order below)
# Steps, each under its own timeout and each going on after a failed one (expected wall time on an H100 machine):
#   mixtral    Mixtral-8x7B-shaped (hidden 4096, 8 experts of 14336, vocab 32000), 4 layers: 12.1 GB bf16, the most
#              that leaves time for the other steps. bench/convert.py with --quantize-experts on cuda against its
#              floor, output kept for `memory`; again without the flag (size and time). About 80 s with generation.
#   memory     bench/moe_memory.py on that output: load_for_fsdp on 1 rank (NCCL), LoRA on attention and every
#              expert, one step of 256 tokens, against transformers 5's quantize-on-load of the bf16 source (experts
#              stay 16-bit) with LoRA on attention: peak GPU memory at load and in the step. About 90 s.
#   qwen3      Qwen3-30B-A3B-shaped (hidden 2048, 128 experts of 768, vocab 151936), 4 layers: 6.2 GB bf16, the same
#              two conversions. About 50 s.
#   deepseek   DeepSeek-V3-shaped FP8 (hidden 7168, 256 routed experts of 2048 + 1 shared, MLA attention, vocab
#              129280), layer 0 dense (18432) + 1 MoE layer: 0.58 + 11.5 GB FP8 with 128x128 scales + 3.7 GB bf16
#              embedding and head = 15.8 GB; --quantize-experts on cuda against its floor, RssAnon. About 100 s.
#   gpu-tests  the tests marked gpu of the MoE and FP8 modules. About 90 s.
# In all about 470 s, with the wheels' install and the libraries' first import (about 20 s).
# Disk (64 GB): one source at a time (at most 15.8 GB) beside its outputs (at most 12 GB), each removed after its step.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_TELEMETRY=1
export PYTHONPYCACHEPREFIX=/tmp/pycache   # the GPU image keeps no bytecode between processes
unset PYTHONDONTWRITEBYTECODE
OUT=${OUT:-/tmp/prequant-moe-out}
WORK=${PREQUANT_WORK:-/tmp/prequant-moe}
DEADLINE=${PREQUANT_DEADLINE:-540}
STEPS=${PREQUANT_STEPS:-mixtral memory qwen3 deepseek gpu-tests}
DEVICE=cuda
LAYERS_MIXTRAL=4 LAYERS_QWEN3=${QWEN3_LAYERS:-4} LAYERS_DEEPSEEK=2  # QWEN3_LAYERS=16: the per-tensor work at scale
DIMS_MIXTRAL= DIMS_QWEN3= DIMS_DEEPSEEK=
if [ -n "${TINY:-}" ]; then  # the same steps at reduced dimensions, on the CPU
  DEVICE=cpu
  DIMS_MIXTRAL='{"hidden": 256, "inter": 512, "heads": 4, "kv_heads": 2, "vocab": 512}'
  DIMS_QWEN3='{"hidden": 256, "inter": 64, "heads": 4, "kv_heads": 2, "head_dim": 64, "experts": 16, "vocab": 512}'
  DIMS_DEEPSEEK='{"hidden": 320, "inter": 96, "dense_inter": 400, "heads": 4, "experts": 8, "groups": 2,
    "topk_groups": 1, "active": 2, "q_lora": 192, "kv_lora": 128, "rope": 16, "nope": 32, "v_head": 32, "vocab": 512}'
fi
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE_PID=$!
START=$(date +%s)
FAILED=()
# shellcheck source=scripts/gpu/gpu_steps.sh
source "$(dirname "$0")/gpu_steps.sh"  # left, step, install_wheels, report_machine, finish
trap finish EXIT
python3 -c "import bitsandbytes" 2>/dev/null || install_wheels /tmp/site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
report_machine

want() { [[ " $STEPS " == *" $1 "* ]]; }
# bench SHAPE LAYERS DIMS JSON: ARGS, bench/convert.py's arguments for the generated checkpoint WORK/SHAPE-LAYERSlayers
bench() {
  ARGS=(scripts/bench/convert.py --shape "$1" --layers "$2" ${3:+--dims "$3"} --device "$DEVICE" --warm-libraries
        --dir "$WORK" --json "$OUT/$4")
}

if want mixtral || want memory; then
  bench mixtral "$LAYERS_MIXTRAL" "$DIMS_MIXTRAL" mixtral-experts.json
  step mixtral-experts 200 python3 "${ARGS[@]}" --prequant-arg=--quantize-experts --keep
  rm -rf "$WORK/mixtral-4bit"; mv "$WORK/out-prequant" "$WORK/mixtral-4bit" 2>/dev/null
  bench mixtral "$LAYERS_MIXTRAL" "$DIMS_MIXTRAL" mixtral-kept.json
  want mixtral && step mixtral-kept 90 python3 "${ARGS[@]}"
  want memory && step memory 180 python3 scripts/bench/moe_memory.py --checkpoint "$WORK/mixtral-4bit" \
    --source "$WORK/mixtral-${LAYERS_MIXTRAL}layers" --timeout 170 --json "$OUT/memory.json"
  rm -rf "$WORK"/mixtral-* "$WORK"/out-*
fi
if want qwen3; then
  bench qwen3_moe "$LAYERS_QWEN3" "$DIMS_QWEN3" qwen3-experts.json
  step qwen3-experts 200 python3 "${ARGS[@]}" --prequant-arg=--quantize-experts
  bench qwen3_moe "$LAYERS_QWEN3" "$DIMS_QWEN3" qwen3-kept.json
  step qwen3-kept 120 python3 "${ARGS[@]}"
  rm -rf "$WORK"/qwen3_moe-* "$WORK"/out-*
fi
if want deepseek; then
  bench deepseek_v3 "$LAYERS_DEEPSEEK" "$DIMS_DEEPSEEK" deepseek-fp8-experts.json
  step deepseek-fp8 200 python3 "${ARGS[@]}" --prequant-arg=--quantize-experts
  rm -rf "$WORK"/deepseek_v3-* "$WORK"/out-*
fi
if want gpu-tests; then
  step gpu-tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/bnb/test_moe_experts.py \
    tests/conversion/test_convert_experts.py tests/conversion/test_convert_gpu.py tests/conversion/test_fp8.py \
    tests/checkpoint/test_fp8_weights.py
fi

# summary.md: one line per conversion, and the memory comparison; a missing file or figure shows as "?".
python3 - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return {}
def f(v, scale=1.0, fmt=".2f"):
    return "?" if v is None else format(v / scale, fmt)
print("| source | device | source GB | output GB | output / source | convert s | floor s | x floor | RssAnon GiB |"
      " GPU GiB (NVML / torch reserved) |\n|---|---|---|---|---|---|---|---|---|---|")
for name, label in (("mixtral-experts", "Mixtral-8x7B-shaped, --quantize-experts"),
                    ("mixtral-kept", "Mixtral-8x7B-shaped, experts kept"),
                    ("qwen3-experts", "Qwen3-30B-A3B-shaped, --quantize-experts"),
                    ("qwen3-kept", "Qwen3-30B-A3B-shaped, experts kept"),
                    ("deepseek-fp8-experts", "DeepSeek-V3-shaped FP8, --quantize-experts")):
    r = load(f"{name}.json")
    p, floor = r.get("prequant", {}), r.get("read_write", {})
    src, dst = r.get("source_bytes"), p.get("output_bytes")
    print(f"| {label} | {r.get('device', '?')} | {f(src, 1e9)} | {f(dst, 1e9)} | "
          f"{f(dst / src if src and dst else None, 1, '.3f')} | {f(p.get('seconds'), 1, '.1f')} | "
          f"{f(floor.get('seconds'), 1, '.1f')} | {f(p.get('ratio_to_floor'))} | {f(p.get('peak_rss_anon'), 2**30)} | "
          f"{f(p.get('peak_gpu_process_bytes'), 2**30)} / {f(p.get('peak_gpu_bytes'), 2**30)} |")
m = load("memory.json")
print("\n| Mixtral-8x7B-shaped, 1 GPU | load: peak allocated GiB | step: peak allocated GiB |"
      " load / step reserved GiB | 4-bit linears | LoRA modules | error |\n|---|---|---|---|---|---|---|")
for loader, label in (("prequant", "prequant load_for_fsdp, 4-bit experts, LoRA on attention + experts"),
                      ("transformers", "transformers 5 quantize-on-load of bf16, experts 16-bit, LoRA on attention")):
    r = m.get(loader, {})
    l, s = r.get("load", {}), r.get("step", {})
    print(f"| {label} | {f(l.get('peak_gpu_allocated'), 2**30)} | {f(s.get('peak_gpu_allocated'), 2**30)} | "
          f"{f(l.get('peak_gpu_reserved'), 2**30)} / {f(s.get('peak_gpu_reserved'), 2**30)} | "
          f"{r.get('linear4bit_modules', '?')} | {r.get('lora_modules', '?')} | {r.get('error', '')} |")
EOF
