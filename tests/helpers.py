"""Shared test helpers: tiny checkpoints built from transformers configs, the CLI in a subprocess, markers.

Test modules import what they use from here (`from helpers import run_cli`); conftest.py holds the fixtures and the
session's environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = [pytest.mark.gpu, cuda]  # marks for whatever needs a CUDA GPU (skipped without one)


def gpu_only(test):
    """Mark a test as a GPU test (`-m gpu` selects them; without CUDA they skip)."""
    for mark in GPU:
        test = mark(test)
    return test

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)


def model_config(kind: str):
    """A tiny config for each decoder layout users bring."""
    import transformers as tf

    if kind == "llama":
        return tf.LlamaConfig(**SMALL, num_key_value_heads=2)
    if kind == "llama_tied":  # tied input/output embeddings
        return tf.LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=True)
    if kind == "gpt2":  # Conv1D layers stored [in, out], biases, tied embeddings, fp32
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    if kind == "qwen2":  # q/k/v projections with biases
        return tf.Qwen2Config(**SMALL, num_key_value_heads=2)
    if kind == "qwen3":  # q/k norms, head_dim given apart from hidden_size / heads
        return tf.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=32)
    if kind == "gemma":  # tied embeddings by default
        return tf.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=16)
    if kind == "mistral":
        return tf.MistralConfig(**SMALL, num_key_value_heads=2)
    if kind == "mixtral":  # native MoE: transformers 5 fuses the experts into 3-D parameters
        return tf.MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen3_moe":  # routed experts in layer 1, a dense MLP in layer 0
        return tf.Qwen3MoeConfig(**SMALL, num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32,
                                 num_experts_per_tok=2, mlp_only_layers=[0])
    raise ValueError(kind)


DTYPES = {"gpt2": torch.float32}


def build_checkpoint(kind: str, path: Path, *, max_shard_size: str | None = None, seed: int = 0) -> Path:
    """Save a randomly initialised tiny model as a Hugging Face checkpoint (safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(kind), dtype=DTYPES.get(kind, torch.bfloat16))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (path / "LICENSE").write_text("test licence\n")
    return path


GROK_CODE = Path(__file__).resolve().parent / "grok"  # the remote-code model
SENTINEL_LINE = (
    'import os as _os\nif _os.environ.get("GROK_SENTINEL"):\n'
    '    open(_os.environ["GROK_SENTINEL"], "a").write("modeling_grok1 imported\\n")\n'
)


def build_grok(path: Path, naming: str, shards: int = 3, seed: int = 0, experts_per_token: int = 2) -> Path:
    """A tiny Grok-1 checkpoint as `pytorch_model-*.bin` shards with its model code beside it. (Untrained, its routers
    send every token of a layer to the same experts: `experts_per_token=4` uses all four.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True)
    shutil.copy(GROK_CODE / "configuration_grok1.py", path)
    # The copy announces every import of itself, so a test can prove conversion never ran it.
    (path / "modeling_grok1.py").write_text(SENTINEL_LINE + (GROK_CODE / "modeling_grok1.py").read_text())
    config = {
        "architectures": ["Grok1ModelForCausalLM"],
        "model_type": "grok-1",
        "auto_map": {
            "AutoConfig": "configuration_grok1.Grok1Config",
            "AutoModelForCausalLM": "modeling_grok1.Grok1ModelForCausalLM",
        },
        "naming": naming,
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": experts_per_token,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    env_sentinel = os.environ.pop("GROK_SENTINEL", None)  # building runs the code; that's not conversion
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=True)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True, dtype=torch.bfloat16)
    finally:
        if env_sentinel is not None:
            os.environ["GROK_SENTINEL"] = env_sentinel
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = list(state)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in names[i * per : (i + 1) * per]}
        torch.save(part, path / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


TOKENIZER_WORDS = ("the a cat dog sat on mat ran to park it was sunny day and night hello world how are you fine "
                   "thanks what is two plus four six").split()
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' </s> ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")


def build_tokenizer(path: Path) -> Path:
    """A small word-level tokenizer (ids below the tiny models' vocab of 256) with a chat template, saved at `path`:
    the tiny checkpoints have none, and tests download nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for word in TOKENIZER_WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=64)
    fast.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


class Evil:
    """Unpickling this runs a shell command: exactly what weights_only must refuse."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


Q0, K0, UP1 = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
               "model.layers.1.mlp.up_proj.weight")
MIXES = {  # tensor -> the dtype it is stored in, in a bf16 Llama (quantized ones and kept ones)
    "fp32-in-bf16": {Q0: torch.float32, UP1: torch.float32, "model.layers.0.input_layernorm.weight": torch.float32,
                     "lm_head.weight": torch.float32},
    "fp16-in-bf16": {Q0: torch.float16, UP1: torch.float16, "model.layers.0.input_layernorm.weight": torch.float16,
                     "lm_head.weight": torch.float16},
    "mixed": {Q0: torch.float32, K0: torch.float16, "model.norm.weight": torch.float32,
              "model.embed_tokens.weight": torch.float16},
}


def retyped(src: Path, dst: Path, dtypes: dict[str, torch.dtype]) -> Path:
    """A copy of `src` with the named tensors stored in other dtypes, their values moved off the bf16 grid (so
    that the cast to bf16 has to round)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name, dtype in dtypes.items():
        t = tensors[name].float()
        tensors[name] = (t + torch.randn(t.shape, generator=generator) * t.abs().mean() * 1e-2).to(dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def bnb_config(**overrides):
    from transformers import BitsAndBytesConfig

    args = dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    args.update(overrides)
    return BitsAndBytesConfig(**args)


def transformers_reference(src: Path, out: Path, device: str = "cpu", **overrides) -> Path:
    """What users do today: quantize on load, then save_pretrained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=bnb_config(**overrides), device_map=device)
    model.save_pretrained(out)
    return out


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by key (tiny checkpoints only)."""
    from safetensors import safe_open

    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                tensors[k] = h.get_tensor(k)
    return tensors


def rehash(out: Path, *names: str) -> None:
    """Update an output's prequant.json for edited files, so only verify's other checks can catch the edit."""
    from prequant.checkpoint.manifest import sha256_file

    manifest = json.loads((out / "prequant.json").read_text())
    for name in names:
        manifest["files"][name] = {"size": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
    (out / "prequant.json").write_text(json.dumps(manifest))


def cli_env(env: dict | None = None) -> dict:
    """The environment the CLI runs in: this one, with this checkout's prequant first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}


def start_cli(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """`python -m prequant ARGS` started in the background (text pipes for stdout and stderr)."""
    popen.setdefault("cwd", ROOT)
    return subprocess.Popen([sys.executable, "-m", "prequant", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env(env), **popen)


def run_cli(*args: str, env: dict | None = None, check: bool | None = None, **popen) -> subprocess.CompletedProcess:
    """`python -m prequant ARGS` in a subprocess, as a user runs it; `popen` (e.g. preexec_fn, cwd) goes to subprocess.run."""
    popen.setdefault("cwd", ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "prequant", *args], capture_output=True, text=True, env=cli_env(env), timeout=600, **popen
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_main(*args: str) -> tuple[int, str, str]:
    """`prequant ARGS` in this process (no interpreter start-up: fast); returns (exit code, stdout, stderr)."""
    import contextlib
    import io

    from prequant.cli import main

    out, err, argv, code = io.StringIO(), io.StringIO(), sys.argv, 0
    sys.argv = ["prequant", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


ORIGINAL_CARD = """---
license: other
license_name: tiny-licence
license_link: LICENSE
extra_gated_prompt: Accept the tiny licence first.
language: en
tags:
- text-generation
---
# Tiny Llama

Trained on nothing; for tests only.
"""


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `script` (a test module run as a worker) on `nproc` ranks under torchrun, with the checkout and the tests'
    own helpers on its path; a failing rank fails the test with the end of its stderr."""
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(script), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def finish_worker(record: object, path: str | Path) -> None:
    """A worker's end on every rank: rank 0 saves `record` at `path`, then the ranks leave the process group."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(record, path)
    dist.barrier()
    dist.destroy_process_group()
