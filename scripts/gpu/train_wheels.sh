#!/usr/bin/env bash
# The wheels that scripts/trainer_gpu_check.sh needs on the GPU machine beyond its image (torch, transformers,
# accelerate, peft, safetensors, huggingface_hub preinstalled): TRL and datasets with the dependencies a torch image
# lacks, and accelerate 1.15 (earlier releases write FSDP2 checkpoints of a peft adapter from rank 0's shards alone),
# for CPython 3.12 on x86-64 Linux, into ./.whl (git-excluded) of the repo you run this from. bitsandbytes comes
# from the lead's own wheel script. Run it where PyPI is reachable.
#
#   bash scripts/gpu/train_wheels.sh            # then carry [".whl"]; trainer_gpu_check.sh installs them itself
#
# pyarrow's wheel is 55 MB, most of what may travel (64 MiB with the repo). Dropped from it: Arrow Flight, the S3
# filesystem, the C++ headers and the tests (about 19 MB), which datasets' local JSON loading, its fingerprints and
# its map never load; every other library stays, since pyarrow.lib links them. pandas (12 MB) is skipped with
# SKIP_PANDAS=1 when the image has it.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EXCLUDE=$(git rev-parse --git-path info/exclude)   # also in a worktree, where .git is a file
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
mkdir -p .whl
SPECS=("trl==${TRL_VERSION:-1.16.0}" "datasets==${DATASETS_VERSION:-5.2.0}" "accelerate==1.15.0" "pyarrow==26.0.1"
       "dill==0.4.1" "multiprocess==0.70.19" "xxhash==4.1.0")
# huggingface_hub 1.33: datasets 5.2 needs 1.31 or later, transformers 5.17 a 1.x (the combination tested); its
# own dependencies (httpx, hf-xet, click) are the image's. SKIP_HUB=1 when the image has 1.31 or later.
[ "${SKIP_HUB:-0}" = 1 ] || SPECS+=("huggingface_hub==1.33.0")
[ "${SKIP_PANDAS:-0}" = 1 ] || SPECS+=("pandas==3.1.1" "python-dateutil==4.0.0" "tzdata==2026.6")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${SPECS[@]}"
for w in .whl/pyarrow-*.whl; do
  python3 - "$w" <<'PY'
import os, sys, zipfile
src = sys.argv[1]; tmp = src + ".tmp"
def dropped(name: str) -> bool:
    base = os.path.basename(name)
    return ("flight" in base or base.startswith(("libarrow_s3", "_s3fs")) or name.startswith(("pyarrow/include/",
            "pyarrow/tests/", "pyarrow/src/")) or base.startswith("_pyarrow_cpp_tests"))
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
    for item in zi.infolist():
        if not dropped(item.filename):
            zo.writestr(item, zi.read(item.filename))
os.replace(tmp, src)
PY
done
ls -la .whl
du -ch .whl/*.whl | tail -1
