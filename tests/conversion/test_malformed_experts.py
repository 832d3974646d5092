"""MoE sources whose experts disagree with config.json (an expert transposed, one missing in every layer, one more
than the config's count, one of another size) are refused before OUTPUT_DIR is claimed, with and without
--quantize-experts, as transformers' from_pretrained refuses them; `verify --source` catches them too."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from helpers import rehash, run_cli, run_main
from moe_checkpoints import DEFECTS, break_experts, build_moe

import prequant
from prequant.verify.run import verify

KINDS = ["mixtral", "qwen3_moe", "deepseek_v3"]  # Mixtral's naming (w1/w2/w3), Qwen's, DeepSeek's dense first layer
# What each refusal says went wrong, besides the tensor's name.
SAYS = {"transposed": ("has shape", "(it is stored transposed)"), "missing": ("is missing",),
        "extra": ("is expert 4,", "numbered 0 to 3"), "reshaped": ("has shape", "for each expert's part of")}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """kind -> a valid tiny MoE checkpoint, built once per module (copied before any edit)."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = build_moe(kind, tmp_path_factory.mktemp(kind) / "src")
        return cache[kind]

    return get


def broken(good_src: Path, where: Path, defect: str) -> tuple[Path, list[str]]:
    """A copy of `good_src` at `where` with `defect` (`break_experts`), and the tensors the refusal may name."""
    src = Path(shutil.copytree(good_src, where))
    return src, break_experts(src, defect)


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("flag", [(), ("--quantize-experts",)], ids=["experts-kept", "quantize-experts"])
@pytest.mark.parametrize("defect", DEFECTS)
@pytest.mark.parametrize("kind", KINDS)
def test_experts_that_disagree_with_the_config_are_refused_before_output_dir_is_claimed(good, tmp_path, kind, defect,
                                                                                         flag):
    src, concerned = broken(good(kind), tmp_path / "src", defect)
    before = snapshot(src)
    out = tmp_path / "out"
    code, stdout, stderr = run_main("convert", str(src), str(out), "--device", "cpu", *flag)
    assert code == 1 and stdout == "", stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    message = lines[0]
    assert "model.safetensors" in message and any(f"'{name}'" in message for name in concerned), message
    assert all(phrase in message for phrase in SAYS[defect]), message
    assert "config.json" in message and "re-download" in message, message  # why, and what to do
    assert not out.exists()  # nothing claimed: a corrected source converts without --overwrite
    assert snapshot(src) == before


def test_the_refusal_is_one_line_without_a_traceback_from_the_installed_cli(good, tmp_path):
    src, concerned = broken(good("qwen3_moe"), tmp_path / "src", "missing")
    proc = run_cli("convert", str(src), str(tmp_path / "out"), "--device", "cpu", "--quantize-experts",
                   env={"PREQUANT_DEBUG": ""})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("Error: model.safetensors: ") and any(name in line for name in concerned), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_dry_run_refuses_them_too(good, tmp_path, kind):
    src, concerned = broken(good(kind), tmp_path / "src", "transposed")
    with pytest.raises(prequant.PrequantError) as e:
        prequant.convert(src, tmp_path / "out", dry_run=True)
    assert e.value.where == "model.safetensors" and concerned[0] in e.value.detail


def _edit(src: Path, edit) -> None:
    """Apply `edit(tensors)` to the checkpoint's one safetensors file."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


def test_an_expert_given_twice_is_refused(good, tmp_path):
    src = Path(shutil.copytree(good("qwen3_moe"), tmp_path / "src"))
    name = "model.layers.1.mlp.experts.1.gate_proj.weight"
    again = name.replace(".1.gate_proj", ".01.gate_proj")  # the same number, spelt otherwise
    _edit(src, lambda t: t.update({again: t[name].clone()}))
    with pytest.raises(prequant.PrequantError) as e:
        prequant.convert(src, tmp_path / "out", dry_run=True)
    assert "is expert 1 of model.layers.1.mlp.experts.gate_up_proj, which" in e.value.detail
    assert {name, again} <= {n.strip("'") for n in e.value.detail.split() if n.startswith("'")}


def test_a_projection_absent_from_every_expert_is_refused_naming_its_pattern(good, tmp_path):
    src = Path(shutil.copytree(good("qwen3_moe"), tmp_path / "src"))
    layer = "model.layers.1."
    _edit(src, lambda t: [t.pop(n) for n in list(t) if n.startswith(layer) and n.endswith("up_proj.weight")])
    with pytest.raises(prequant.PrequantError) as e:
        prequant.convert(src, tmp_path / "out", dry_run=True)
    assert e.value.detail.startswith("the checkpoint holds no tensor matching 'mlp.experts.*.up_proj.weight' for "
                                     "model.layers.1.mlp.experts.gate_up_proj, but Qwen3MoeForCausalLM built from "
                                     "config.json takes one for each of its 4 experts;")


@pytest.mark.parametrize("defect", DEFECTS)
@pytest.mark.parametrize("kind", KINDS)
def test_verify_against_a_malformed_source_fails_naming_its_tensor(good, tmp_path, kind, defect):
    """The output an older prequant wrote from a malformed source: its experts kept as the source holds them (the
    valid conversion, with the same defect made in its shard, its manifest updated), which matches the source tensor
    for tensor; the source itself is what transformers would refuse, and verify says so."""
    out = tmp_path / "out"
    prequant.convert(good(kind), out, device="cpu", progress=False, stats=False)
    src, concerned = broken(good(kind), tmp_path / "src", defect)
    assert break_experts(out, defect) == concerned
    rehash(out, "model.safetensors")
    report = verify(out, source=str(src), progress=False)
    assert not report.ok
    problem = next(str(p) for p in report.problems if any(name in str(p) for name in concerned))
    assert problem.startswith("source model.safetensors: ") and "config.json" in problem, report.to_text()
    code, stdout, _ = run_main("verify", str(out), "--source", str(src))
    assert code == 1 and "FAILED" in stdout and any(name in stdout for name in concerned), stdout



def test_converters_of_another_shape_cost_the_fused_checks_not_the_renaming(good, monkeypatch):
    """A transformers whose experts' converters read otherwise than `_stacking` expects: transformers' layout still
    renames every key (the experts still fused), only the fused shapes go unchecked."""
    from prequant.bnb import layout
    from prequant.checkpoint.reader import scan_files

    def changed(converter, part):
        raise AttributeError("operations")

    src = good("mixtral")
    config, tensors = json.loads((src / "config.json").read_text()), scan_files(sorted(src.glob("*.safetensors")))
    wanted = layout.analyze(config, src, tensors, [])
    monkeypatch.setattr(layout, "_stacking", changed)
    got = layout.analyze(config, src, tensors, [])
    assert got.decisions == wanted.decisions
    experts = [t.name for t in tensors if ".experts.0." in t.name]
    assert experts and all(got.decisions[name].fused for name in experts)
