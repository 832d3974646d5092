"""conversion.writer: a shard's writes start their writeback in steps of WRITEBACK_BYTES, not once per tensor.

What must hold: a shard of many small tensors (a MoE layer's experts) asks the kernel to start writeback about once
per WRITEBACK_BYTES written, over the whole file, and its bytes are the tensors written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from prequant.conversion import writer
from prequant.conversion.plan import OutTensor


@pytest.mark.skipif(writer._SYNC_FILE_RANGE is None, reason="no sync_file_range here")
def test_many_small_tensors_start_writeback_once_per_step(tmp_path, monkeypatch):
    real, calls = writer._SYNC_FILE_RANGE, []

    def counted(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writer, "_SYNC_FILE_RANGE", counted)
    monkeypatch.setattr(writer, "WRITEBACK_BYTES", 1 << 20)
    count, numel = 64, 1 << 16  # 64 tensors of 256 KiB: 16 MiB, 16 steps of 1 MiB
    w = writer.ShardWriter(tmp_path / "s.safetensors", [OutTensor(f"t{i}", "F32", (numel,)) for i in range(count)])
    tensors = {f"t{i}": torch.full((numel,), float(i)) for i in range(count)}
    for key in reversed(list(tensors)):  # in any order
        w.write(key, tensors[key])
    path = w.finalize()
    assert calls == [(0, 0)] * (count * numel * 4 // (1 << 20))
    got = load_file(path)
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())


def test_a_header_is_the_whole_json_object_of_its_tensors():
    """The fixed part of a layout's header is encoded once and the variable-size entries joined to it: the bytes are
    those of the header encoded as one JSON object (non-ASCII names escaped alike), with or without variable ones."""
    fixed = [OutTensor("b.weight", "U8", (8, 1)), OutTensor("a.absmax", "F32", (2,)), OutTensor("é.w", "BF16", (3,))]
    variable = [OutTensor("b.weight.quant_state.bitsandbytes__nf4", "U8", None), OutTensor("ü.state", "U8", None)]
    for entries in (fixed, fixed + variable):
        layout = writer.ShardLayout(entries, {"format": "pt"})
        sizes = {e.key: 150 + i for i, e in enumerate(layout.variable)}
        whole: dict[str, object] = {"__metadata__": {"format": "pt"}}
        for e in layout.fixed:
            whole[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": list(layout.offsets[e.key])}
        pos = layout.fixed_end
        for e in layout.variable:
            whole[e.key] = {"dtype": e.dtype, "shape": [sizes[e.key]], "data_offsets": [pos, pos + sizes[e.key]]}
            pos += sizes[e.key]
        assert layout.header(sizes) == json.dumps(whole, separators=(",", ":")).encode()
        assert json.loads(layout.header(sizes)) == whole
