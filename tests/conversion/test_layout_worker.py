"""The layout decided in a child process (started by the CLI) is the in-process layout, or is not used."""

import json

import pytest

import prequant
from prequant.bnb import layout as architectures
from prequant.bnb import predict
from prequant.checkpoint import hf_files
from prequant.conversion import layout_worker
from prequant.source import resolve as sources

from conftest import run_main


@pytest.fixture(autouse=True)
def unsettled(monkeypatch):
    """The child is for layouts not settled from names: here every checkpoint is treated so."""
    monkeypatch.setenv(predict.CONFIRM_ENV, "1")


def _in_process(src_dir, skip=(), trust=False):
    src = sources.resolve(str(src_dir))
    tensors = sources.scan(src)
    layout = architectures.analyze(hf_files.read_config(src.path), src.path, tensors, list(skip), trust)
    return src, tensors, layout


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral"])
def test_child_decides_exactly_what_this_process_decides(checkpoints, kind):
    src, tensors, expected = _in_process(checkpoints(kind))
    layout_worker.start(str(src.path), [], False)
    got = layout_worker.take(src.path, tensors, [], False)
    assert got is not None, "the child's answer was not used"
    assert got == expected


def test_child_answer_to_another_question_is_not_used(checkpoints):
    src, tensors, _ = _in_process(checkpoints("llama"))
    layout_worker.start(str(src.path), ["mlp"], False)
    assert layout_worker.take(src.path, tensors, [], False) is None  # other skip list
    layout_worker.start(str(src.path), [], False)
    assert layout_worker.take(src.path, tensors[:-1], [], False) is None  # other tensors (files changed meanwhile)
    layout_worker.start(str(src.path), [], False)
    assert layout_worker.take(src.path, tensors, [], False) is not None
    assert layout_worker.take(src.path, tensors, [], False) is None  # an answer is taken once


def test_no_child_for_what_is_not_a_local_checkpoint(tmp_path):
    layout_worker.start("org/some-model", [], False)
    layout_worker.start(str(tmp_path / "missing"), [], False)
    assert layout_worker._child is None


@pytest.mark.skipif(not predict.verified(), reason="the installed transformers is outside predict.VERIFIED")
def test_no_child_where_the_layout_may_settle_from_names(checkpoints, monkeypatch):
    monkeypatch.delenv(predict.CONFIRM_ENV)
    layout_worker.start(str(checkpoints("llama")), [], False)
    assert layout_worker._child is None
    monkeypatch.setenv(predict.CONFIRM_ENV, "1")
    layout_worker.start(str(checkpoints("llama")), [], False)
    assert layout_worker._child is not None, "the check above could not have failed"
    layout_worker.drop()
    assert layout_worker._child is None


def test_cli_plan_equals_library_plan(checkpoints, tmp_path, monkeypatch):
    """The CLI (layout from the child, here even on a small machine) and the library (in-process) print the
    same plan, reasons included."""
    src = checkpoints("gpt2")
    taken = []
    take = layout_worker.take
    monkeypatch.setattr(layout_worker, "worthwhile", lambda: True)
    monkeypatch.setattr(layout_worker, "take", lambda *args: taken.append(take(*args)) or taken[-1])
    code, out, err = run_main("convert", str(src), str(tmp_path / "out"), "--dry-run", "--json", "--skip", "h.0.mlp")
    assert code == 0, err
    assert len(taken) == 1 and taken[0] is not None, "the CLI did not use the child's layout"
    library = prequant.convert(src, tmp_path / "out", dry_run=True, skip=["h.0.mlp"])
    assert json.loads(out) == json.loads(json.dumps(library.to_dict()))


def test_child_carries_a_refusal_as_the_parent_would_raise_it(checkpoints, tmp_path):
    """A weight shaped as the model's transpose: the child refuses it, and the parent raises that same error."""
    import shutil

    from test_bad_inputs import GATE_PROJ, _edit_header

    src_dir = shutil.copytree(checkpoints("llama"), tmp_path / "src")
    _edit_header(src_dir / "model.safetensors", lambda h: h[GATE_PROJ].update(shape=h[GATE_PROJ]["shape"][::-1]))
    src = sources.resolve(str(src_dir))
    tensors = sources.scan(src)
    with pytest.raises(prequant.PrequantError) as in_process:
        architectures.analyze(hf_files.read_config(src.path), src.path, tensors, [], False)
    layout_worker.start(str(src.path), [], False)
    with pytest.raises(prequant.PrequantError) as from_child:
        layout_worker.take(src.path, tensors, [], False)
    assert from_child.value.message == in_process.value.message and "expects [128, 64]" in from_child.value.message
