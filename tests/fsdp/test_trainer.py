"""TRL's SFTTrainer (transformers' Trainer under it) training a load_for_fsdp model, for real on 2 gloo ranks.

The distributed part runs this very file under torchrun as a worker (`--worker CONFIG_JSON`): each rank loads a
tiny converted checkpoint with load_for_fsdp, takes the first batch's loss the plain way (the model's own
forward), then SFTTrainer trains with `trainer_args(SFTConfig(...))`, saves its checkpoints and its adapter; the
worker records what the tests compare (losses, logits of a probe batch after training, the gathered LoRA weights,
the state dict's sizes, who set up the process group). Unsharded references run in the test process.

    python -m pytest -q tests/fsdp/test_trainer.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest
import torch
from helpers import ROOT, TOKENIZER_WORDS, build_grok, build_tokenizer

from packaging.version import Version

from prequant.errors import UsageError

TEXT = " ".join(TOKENIZER_WORDS)  # every word the test tokenizer knows: 31 tokens with EOS
PROBE = [[4, 6, 8, 9, 4, 10, 18, 4, 7, 11, 12, 4, 13, 2], [2, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 3, 1]]
LORA = {"lora_r": 4, "lora_alpha": 8, "seed": 0}
# SFTTrainer's loss is TRL's kernel (per-token log-probabilities from its own chunked kernel, summed over the token
# count) where the model's is its cross-entropy: the same number up to float32 rounding, a unit or two in the last
# place on these batches; this is about ten.
SFT_LOSS_RTOL = 1e-6
# A run with the same examples in micro-batches of one (two accumulated) sums the tokens in another order than one
# batch of two: float32 rounding, a few units in the last place of each loss.
ACCUMULATION_RTOL = 1e-6


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tok")


def _env() -> dict:
    """The checkout and the tests' helpers (conftest) importable in a subprocess (the worker is this file)."""
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _torchrun(config: dict, nproc: int = 2, timeout: float = 600) -> dict:
    """Run the worker on `nproc` ranks with `config`; return what rank 0 recorded."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           __file__, "--worker", json.dumps(config)], capture_output=True, text=True, env=_env(),
                          cwd=ROOT, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(Path(config["out"]) / "record.pt", weights_only=False)


def _runs(ckpt: Path, tokenizer: Path, tmp: Path, remote: bool) -> dict:
    """The uninterrupted run (model created first, 3 steps, checkpoint at step 2) and the one resumed from that
    checkpoint (model created after the arguments)."""
    full = _torchrun({"checkpoint": str(ckpt), "tokenizer": str(tokenizer), "out": str(tmp / "full"), "remote": remote,
                      "order": "model", "steps": 3, "batch": 2, "accumulate": 1, "checkpointing": True,
                      "save_steps": 2})
    (tmp / "resumed").mkdir()
    shutil.copytree(tmp / "full" / "checkpoint-2", tmp / "resumed" / "checkpoint-2")
    resumed = _torchrun({"checkpoint": str(ckpt), "tokenizer": str(tokenizer), "out": str(tmp / "resumed"),
                         "remote": remote, "order": "args", "steps": 3, "batch": 2, "accumulate": 1,
                         "checkpointing": True, "save_steps": 2, "resume": str(tmp / "resumed" / "checkpoint-2")})
    return {"full": full, "resumed": resumed, "dir": tmp, "checkpoint": ckpt, "remote": remote}


@pytest.fixture(scope="module")
def llama(converted_llama, tokenizer, tmp_path_factory) -> dict:
    return _runs(converted_llama[1], tokenizer, tmp_path_factory.mktemp("sft-llama"), remote=False)


@pytest.fixture(scope="module", params=["keyfan", "hpcai"])
def grok(request, tokenizer, tmp_path_factory) -> dict:
    import prequant

    base = tmp_path_factory.mktemp(f"sft-grok-{request.param}")
    ckpt = base / f"grok-{request.param}-nf4"  # distinct names: transformers caches remote code by directory name
    # All experts routed (the untrained router picks the same two of four for every token): an expert that got no
    # token before a checkpoint has no optimizer state in it, and torch's optimizer-state loading, which accelerate
    # calls strict, refuses to resume from it (README, FSDP+QLoRA: what is refused).
    src = build_grok(base / f"grok-{request.param}-src", request.param, experts_per_token=4)
    prequant.convert(src, ckpt, device="cpu", progress=False)
    return _runs(ckpt, tokenizer, base, remote=True)


def _unsharded(runs: dict, adapter: Path | None = None, adapter_in_fp32: bool = True) -> torch.nn.Module:
    """transformers + peft on one process: the seeded LoRA init, or the adapter a run saved."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from prequant.fsdp import init_lora_weights, lora_config

    base = AutoModelForCausalLM.from_pretrained(runs["checkpoint"], dtype=torch.bfloat16,
                                                trust_remote_code=runs["remote"])
    if adapter is None:
        model = get_peft_model(base, lora_config(LORA["lora_r"], LORA["lora_alpha"], 0.0, "all-linear"))
        init_lora_weights(model, LORA["seed"])
    else:
        model = PeftModel.from_pretrained(base, adapter, autocast_adapter_dtype=adapter_in_fp32)
    return model.train()  # as in training (bitsandbytes' CPU path repacks weights in eval mode)


def _first_loss_checks(runs: dict) -> None:
    full = runs["full"]
    ids = torch.tensor(full["first_batch"])
    with torch.no_grad():
        reference = _unsharded(runs)(input_ids=ids, labels=ids).loss.item()
    assert len(full["losses"]) == 3 and all(math.isfinite(x) for x in full["losses"])
    assert full["plain_loss"] == reference  # load_for_fsdp's own forward = unsharded transformers + peft, to the bit
    # SFTTrainer's loss is TRL's kernel (see SFT_LOSS_RTOL), over the batch the plain loss was taken on
    assert math.isclose(full["losses"][0], full["plain_loss"], rel_tol=SFT_LOSS_RTOL), (full["losses"][0], reference)


def _reload_checks(runs: dict) -> None:
    full, adapter = runs["full"], runs["dir"] / "full" / "final"
    probe = torch.tensor(PROBE)
    with torch.no_grad():  # the adapter in the dtype FSDP2 computed it in during training (bf16): the same logits
        logits = _unsharded(runs, adapter, adapter_in_fp32=False)(input_ids=probe).logits
    assert torch.equal(logits, full["probe_logits"])
    trained = {n: p for n, p in _unsharded(runs, adapter).named_parameters() if ".lora_" in n}  # peft's default: fp32
    assert trained.keys() == full["lora"].keys() and len(trained) > 0
    assert all(torch.equal(p, full["lora"][n]) for n, p in trained.items())  # the fp32 masters, as trained
    assert any(p.abs().sum() > 0 for n, p in trained.items() if ".lora_B." in n)  # B moved away from zero


def _resume_checks(runs: dict) -> None:
    from safetensors.torch import load_file

    full, resumed = runs["full"], runs["resumed"]
    assert resumed["losses"] == full["losses"]  # steps 1-2 from the checkpoint's history, step 3 trained again
    a = load_file(runs["dir"] / "full" / "final" / "adapter_model.safetensors")
    b = load_file(runs["dir"] / "resumed" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------- tiny Llama, 2 ranks


@pytest.mark.slow
def test_sft_first_loss_equals_plain_loop_and_unsharded_transformers_peft(llama):
    _first_loss_checks(llama)


@pytest.mark.slow
def test_saved_adapter_reloads_unsharded_with_the_same_logits(llama):
    _reload_checks(llama)


@pytest.mark.slow
def test_resumed_run_continues_with_the_same_losses(llama):
    _resume_checks(llama)


@pytest.mark.slow
def test_model_created_before_or_after_the_arguments_shares_one_process_group(llama):
    full, resumed = llama["full"], llama["resumed"]
    assert not full["group_before_model"] and resumed["group_before_model"]  # load_for_fsdp / TrainingArguments
    for run in (full, resumed):
        assert run["backend"] == "gloo" and run["distributed_type"] == "FSDP" and run["is_fsdp_enabled"]


@pytest.mark.slow
def test_checkpoints_and_saves_gather_the_adapter_alone(llama):
    sizes = llama["full"]["state_dict_sizes"]
    lora = {k for k in sizes if ".lora_" in k}
    assert lora and all(sizes[k] > 0 for k in lora)
    assert all(sizes[k] == 0 for k in sizes if k not in lora)  # frozen weights: empty, so never gathered
    assert not any(".absmax" in k or "quant_state" in k for k in sizes)
    checkpoint = llama["dir"] / "full" / "checkpoint-2"
    for name in ("adapter_model.safetensors", "pytorch_model_fsdp.bin", "optimizer.bin", "scheduler.pt"):
        assert (checkpoint / name).is_file(), name
    state = torch.load(checkpoint / "pytorch_model_fsdp.bin", weights_only=True)
    assert state.keys() == {k for k in lora}  # the adapter, complete (both ranks' rows)
    assert all(t.shape == llama["full"]["lora"][k].shape for k, t in state.items())


@pytest.mark.slow
def test_gradient_accumulation_and_checkpointing_train_the_same(llama, tokenizer, tmp_path):
    """Micro-batches of one, accumulated in pairs, without gradient checkpointing: the losses of the run with batches
    of two and checkpointing (TRL's default), up to the order in which float32 sums the tokens."""
    run = _torchrun({"checkpoint": str(llama["checkpoint"]), "tokenizer": str(tokenizer), "out": str(tmp_path),
                     "remote": False, "order": "model", "steps": 3, "batch": 1, "accumulate": 2,
                     "checkpointing": False, "save_steps": 0})
    assert llama["full"]["checkpointing"] and not run["checkpointing"]
    for a, b in zip(run["losses"], llama["full"]["losses"], strict=True):
        assert math.isclose(a, b, rel_tol=ACCUMULATION_RTOL), (run["losses"], llama["full"]["losses"])


@pytest.mark.slow
def test_transformers_trainer_trains_the_model_too(llama, tokenizer, tmp_path):
    """transformers' own Trainer (the model's loss, a language-modeling collator), arguments from trainer_args: its
    first loss is the plain loop's, and save_model writes an adapter that gives the sharded model's logits."""
    run = _torchrun({"checkpoint": str(llama["checkpoint"]), "tokenizer": str(tokenizer), "out": str(tmp_path),
                     "remote": False, "order": "model", "steps": 3, "batch": 2, "accumulate": 1,
                     "checkpointing": True, "save_steps": 0, "trainer": "transformers"})
    assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"])
    assert math.isclose(run["losses"][0], run["plain_loss"], rel_tol=SFT_LOSS_RTOL)
    with torch.no_grad():
        logits = _unsharded(llama, tmp_path / "final", adapter_in_fp32=False)(input_ids=torch.tensor(PROBE)).logits
    assert torch.equal(logits, run["probe_logits"])


# ----------------------------------------------------------------------------------------- tiny Grok-1 (remote code)


@pytest.mark.slow
def test_grok_sft_first_loss_equals_plain_loop_and_unsharded(grok):
    _first_loss_checks(grok)


@pytest.mark.slow
def test_grok_adapter_reloads_unsharded_with_the_same_logits(grok):
    _reload_checks(grok)


@pytest.mark.slow
def test_grok_resumed_run_continues_with_the_same_losses(grok):
    _resume_checks(grok)


# ----------------------------------------------------------------------------------------- trainer_args


def _sft_config(tmp_path, **fields):
    from trl import SFTConfig

    return SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True, max_steps=7, report_to="none", **fields)


def test_trainer_args_ask_accelerate_for_fsdp2_without_rewrapping(tmp_path):
    from trl import SFTConfig

    from prequant.fsdp import trainer_args

    config = _sft_config(tmp_path, learning_rate=3e-4)
    args = trainer_args(config)
    assert type(args) is SFTConfig and args is not config and not config.fsdp  # a copy; the original unchanged
    assert args.fsdp_plugin_args == {"fsdp_version": 2, "auto_wrap_policy": "NO_WRAP",
                                     "cpu_ram_efficient_loading": False, "state_dict_type": "FULL_STATE_DICT",
                                     "activation_checkpointing": False, "reshard_after_forward": True}
    assert args.use_cpu and args.bf16 and args.max_steps == 7 and args.learning_rate == 3e-4


def test_trainer_args_keep_the_scripts_other_fsdp_settings(tmp_path):
    from prequant.fsdp import trainer_args

    args = trainer_args(_sft_config(tmp_path, fsdp=True, fsdp_config={"fsdp_cpu_ram_efficient_loading": True}))
    assert args.fsdp_plugin_args["cpu_ram_efficient_loading"] and args.fsdp_plugin_args["auto_wrap_policy"] == "NO_WRAP"


@pytest.mark.parametrize(("fields", "message"), [
    ({"fsdp_config": {"version": 1}}, "fsdp_config version 1: load_for_fsdp shards with FSDP2"),
    ({"fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}, "Trainer.save_model writes no adapter"),
    ({"fsdp_config": {"fsdp_activation_checkpointing": True}}, "use gradient_checkpointing=True instead"),
    ({"fsdp_config": {"cpu_offload": True}}, "load_for_fsdp shards without CPU offload"),
])
def test_trainer_args_refuse_what_a_sharded_model_cannot_do(tmp_path, fields, message):
    from prequant.fsdp import trainer_args

    config = _sft_config(tmp_path)
    config.fsdp_config = fields["fsdp_config"]  # as a script's fsdp_config reaches trainer_args
    with pytest.raises(UsageError, match=message):
        trainer_args(config)


def test_checkpoints_on_several_ranks_need_an_accelerate_that_gathers_the_adapter(tmp_path):
    from prequant.fsdp.trainer import accelerate_gathers_adapter_checkpoints, check_checkpoints

    capable = accelerate_gathers_adapter_checkpoints()  # read from accelerate's code
    assert capable == (Version(accelerate.__version__) >= Version("1.15.0"))
    saving = _sft_config(tmp_path, save_steps=5)
    if capable:
        check_checkpoints(saving, ranks=2)
    else:
        with pytest.raises(UsageError, match="from rank 0's shards alone, so resuming would be wrong"):
            check_checkpoints(saving, ranks=2)
    check_checkpoints(saving, ranks=1)  # one rank: its shards are the whole adapter
    check_checkpoints(_sft_config(tmp_path, save_strategy="no"), ranks=2)  # no checkpoints: nothing to refuse


def test_trainer_args_refuse_other_objects():
    from prequant.fsdp import trainer_args

    with pytest.raises(UsageError, match="takes TrainingArguments or SFTConfig, not dict"):
        trainer_args({"output_dir": "x"})


def test_frozen_weights_stay_out_of_the_state_dict(converted_llama):
    """On an unsharded peft model too: frozen weights keep their keys with an empty value (so that torch's
    ignore_frozen_params, which pops them by name, still works), bitsandbytes' entries go, LoRA weights stay."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from prequant.fsdp.loader import keep_frozen_weights_out_of_state_dict

    model = _unsharded({"checkpoint": converted_llama[1], "remote": False})
    before = model.state_dict()
    keep_frozen_weights_out_of_state_dict(model)
    after = model.state_dict()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and frozen <= after.keys() and all(after[k].numel() == 0 for k in frozen)
    assert any("quant_state" in k for k in before) and not any("quant_state" in k or "absmax" in k for k in after)
    lora = {k for k in after if ".lora_" in k}
    assert lora == after.keys() - frozen and all(torch.equal(after[k], before[k]) for k in lora)
    assert get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True)).keys() == lora


def test_accelerate_takes_its_fsdp_path_on_gloo_ranks(tmp_path):
    """accelerate alone leaves a gloo run with an FSDP plugin MULTI_CPU (so Trainer would wrap the model in DDP);
    with prequant's accommodation it is FSDP, as on GPUs. Checked in a 1-rank torchrun."""
    out = tmp_path / "types.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                           __file__, "--accelerate-types", str(out)], capture_output=True, text=True, env=_env(),
                          cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    types = json.loads(out.read_text())
    assert types["with prequant"] == "FSDP" and types["fsdp2"] and types["partial state"] == "FSDP"
    assert types["applied"] and not types["applied twice"]
    if Version(accelerate.__version__) <= Version("1.15.0"):  # the releases known to need it
        assert types["accelerate"] == "MULTI_CPU"


@pytest.fixture(scope="module")
def script_runs(converted_llama, tokenizer, tmp_path_factory) -> dict:
    """scripts/sft_trl.py on a JSONL of conversations, 2 ranks: under torchrun, and under accelerate launch with
    TRL's own FSDP2 config (accelerate_configs/fsdp2.yaml)."""
    import trl

    tmp = tmp_path_factory.mktemp("sft-script")
    ckpt = tmp / "nf4"
    shutil.copytree(converted_llama[1], ckpt)
    for f in tokenizer.iterdir():  # what prequant convert copies from a source that has a tokenizer
        shutil.copy(f, ckpt)
    data = tmp / "chats.jsonl"
    chats = [[{"role": "user", "content": "what is two plus four"}, {"role": "assistant", "content": "six"}],
             [{"role": "user", "content": "hello how are you"}, {"role": "assistant", "content": "fine thanks"}]]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats * 8))
    script = [str(ROOT / "scripts" / "sft_trl.py"), str(ckpt), "--data", str(data), "--steps", "3",
              "--max-seq-length", "32", "--save-steps", "2", "--lora-r", "4"]
    launchers = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       str(Path(trl.__file__).parent / "accelerate_configs" / "fsdp2.yaml"), "--num_processes", "2",
                       "--main_process_port", str(_free_port())],
    }
    runs = {"checkpoint": ckpt}
    for name, launcher in launchers.items():
        out = tmp / name
        proc = subprocess.run([*launcher, *script, "--output", str(out)], capture_output=True, text=True, env=_env(),
                              cwd=ROOT, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-5000:]
        runs[name] = (out, proc.stdout + proc.stderr)
    return runs


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sft_example_script_trains_on_chat_jsonl(script_runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, log = script_runs["torchrun"]
    assert f"saved the LoRA adapter to {out}" in log
    assert (out / "checkpoint-2" / "optimizer.bin").is_file() and (out / "chat_template.jinja").is_file()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(script_runs["checkpoint"],
                                                                           dtype=torch.bfloat16), out)
    b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert b and any(p.abs().sum() > 0 for p in b)  # trained


@pytest.mark.slow
def test_accelerate_launch_with_trls_fsdp2_config_trains_the_same(script_runs):
    torchrun, accelerate_launch = script_runs["torchrun"][0], script_runs["accelerate"][0]
    for name in ("adapter_model.safetensors", "checkpoint-2/adapter_model.safetensors"):
        assert (accelerate_launch / name).read_bytes() == (torchrun / name).read_bytes(), name


# ----------------------------------------------------------------------------------------- the workers


def _worker(config: dict) -> None:
    """One rank: load_for_fsdp (before or after the SFTConfig), the plain first loss, SFTTrainer, saves, records."""
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import prequant
    from prequant.fsdp import trainer_args

    out = Path(config["out"])

    plain_trainer = config.get("trainer") == "transformers"  # transformers.Trainer: the model's loss, a collator

    def arguments():
        from transformers import TrainingArguments

        saves = {"save_steps": config["save_steps"]} if config["save_steps"] else {"save_strategy": "no"}
        cls, extra = (TrainingArguments, {}) if plain_trainer else (SFTConfig, {"max_length": 32})
        return trainer_args(cls(
            output_dir=str(out), max_steps=config["steps"], per_device_train_batch_size=config["batch"],
            gradient_accumulation_steps=config["accumulate"], gradient_checkpointing=config["checkpointing"],
            learning_rate=1e-3, logging_steps=1, bf16=True, use_cpu=True, report_to="none", seed=0,
            disable_tqdm=True, **extra, **saves))

    args = arguments() if config["order"] == "args" else None
    group_before_model = dist.is_initialized()
    model = prequant.load_for_fsdp(config["checkpoint"], **LORA, trust_remote_code=config["remote"])
    args = args or arguments()
    tokenizer = AutoTokenizer.from_pretrained(config["tokenizer"])
    if plain_trainer:
        from transformers import DataCollatorForLanguageModeling, Trainer

        ids = tokenizer(TEXT)["input_ids"] + [tokenizer.eos_token_id]
        trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list([{"input_ids": ids}] * 32),
                          processing_class=tokenizer, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    else:
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"text": TEXT}] * 32),
                             processing_class=tokenizer)
    # Every example is TEXT, so every rank's first batch is `batch` copies of its tokens: what the plain loop sees.
    first = torch.tensor([trainer.train_dataset[0]["input_ids"]] * config["batch"] * config["accumulate"])
    with torch.no_grad():
        plain = model(input_ids=first, labels=first).loss.item()
    trainer.train(resume_from_checkpoint=config.get("resume"))
    if config["save_steps"] or config.get("trainer"):
        trainer.save_model(str(out / "final"))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE)).logits
    lora = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    record = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "plain_loss": plain,
              "first_batch": first.tolist(), "probe_logits": logits, "lora": lora,
              "state_dict_sizes": {k: v.numel() for k, v in model.state_dict().items()},
              "group_before_model": group_before_model, "backend": dist.get_backend(),
              "distributed_type": trainer.accelerator.distributed_type.value,
              "is_fsdp_enabled": trainer.is_fsdp_enabled,
              "checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in model.modules())}
    if dist.get_rank() == 0:
        torch.save(record, out / "record.pt")
    dist.barrier()
    dist.destroy_process_group()


def _accelerate_types(out: str) -> None:
    """accelerate's distributed type for a gloo rank with an FSDP2 plugin, without and with the accommodation."""
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    from prequant.fsdp.compat import ensure_accelerate_cpu_fsdp

    def accelerator() -> Accelerator:
        AcceleratorState._reset_state(reset_partial_state=True)
        return Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))

    types = {"accelerate": accelerator().distributed_type.value, "applied": ensure_accelerate_cpu_fsdp()}
    acc = accelerator()
    types.update({"with prequant": acc.distributed_type.value, "fsdp2": acc.is_fsdp2,
                  "partial state": PartialState().distributed_type.value,
                  "applied twice": ensure_accelerate_cpu_fsdp()})
    Path(out).write_text(json.dumps(types))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--accelerate-types")
    a = ap.parse_args()
    _worker(json.loads(a.worker)) if a.worker else _accelerate_types(a.accelerate_types)
