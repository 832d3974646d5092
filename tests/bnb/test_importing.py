"""bnb.importing: the CLI's own process imports bitsandbytes without compiling its fallback kernels.

Each case runs in a fresh interpreter (what has been imported is the point). What must hold: a lean import (and a
first call) leaves the compiler (inductor's compile_fx) unimported and torch.compile as it was; bitsandbytes' kernels give the results of a normal import,
including a fallback kernel that a normal import compiles; torch.compile called from anywhere but bitsandbytes is
torch's own, even during the import; a process not marked lean (a library caller's) imports bitsandbytes as it
is; and a CUDA conversion by the `prequant` command (on the GPU machine) imports neither the compiler nor
torch._dynamo and writes transformers' bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("bitsandbytes")

import torch
from helpers import build_checkpoint, cli_env, gpu_only, read_checkpoint, transformers_reference

# Quantize and dequantize with bitsandbytes on the CPU; an odd last dimension sends dequantize_4bit to the default
# backend's _dequantize_4bit_compute, one of the four a normal import compiles.
PROBE = r"""
import hashlib, json, sys
import torch
from prequant.bnb import importing
if sys.argv[1] == "lean":
    importing.lean()
compile_before = torch.compile
F = importing.functional()
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 129, generator=g).to(torch.bfloat16)
packed, state = F.quantize_4bit(x, quant_type="nf4", compress_statistics=True)
back = F.dequantize_4bit(packed, state)
digest = hashlib.sha256(packed.numpy().tobytes() + back.view(torch.int16).numpy().tobytes()).hexdigest()
print(json.dumps({"compiler": "torch._inductor.compile_fx" in sys.modules, "compile_kept": torch.compile is compile_before,
                  "digest": digest}))
"""


def _probe(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=cli_env(),
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_lean_import_skips_the_compiler_and_gives_the_same_results():
    lean, normal = _probe("lean"), _probe("normal")
    assert not lean["compiler"], "inductor's compile_fx was imported: bitsandbytes' compilations ran"
    assert normal["compiler"], "a normal import compiles (if this fails, bitsandbytes no longer does: drop the lean path)"
    assert lean["compile_kept"] and normal["compile_kept"]
    assert lean["digest"] == normal["digest"]


OTHERS = r"""
import sys, types
import torch
from prequant.bnb import importing
theirs = types.ModuleType("bitsandbytes.fake")
exec("def call(fn):\n    import torch\n    return torch.compile(fn)\n", theirs.__dict__)
def mine(x):
    return x + 1
with importing._compile_answered_for_bitsandbytes():
    assert theirs.call(mine) is mine, "bitsandbytes' call answered with the function itself"
    assert torch.compile(mine) is not mine, "anyone else's call is torch's"
    assert torch.compile()(mine) is not mine
assert "torch._dynamo" in sys.modules
print("ok")
"""


def test_only_bitsandbytes_calls_are_answered():
    proc = subprocess.run([sys.executable, "-c", OTHERS], capture_output=True, text=True, env=cli_env(), timeout=300,
                          check=False)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@gpu_only
def test_a_cuda_conversion_by_the_command_imports_no_compiler_and_writes_transformers_bytes(tmp_path):
    """The `prequant` command's process is lean: its CUDA conversion never imports inductor's compile_fx, nor
    torch._dynamo, which torch's dispatch of bitsandbytes' kernels would import (`-X importtime` lists every module a
    process imports), and the bytes are transformers' own."""
    src = build_checkpoint("llama", tmp_path / "src")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "prequant", "convert", str(src), str(out),
                           "--device", "cuda"], capture_output=True, text=True, timeout=600, check=False,
                          env=cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "bitsandbytes.functional" in imported, "the conversion quantized with bitsandbytes"
    assert "torch._inductor.compile_fx" not in imported
    assert "torch._dynamo" not in imported, "a kernel was called through torch's dispatch (see bnb.cuda)"
    ours, want = read_checkpoint(out), read_checkpoint(transformers_reference(src, tmp_path / "ref", device="cuda"))
    assert ours.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(ours[key].view(torch.uint8), tensor.view(torch.uint8)), key
