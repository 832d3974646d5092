"""Every broken or hostile input is refused cleanly, through the real CLI.

One table, one behaviour per row. Each row builds a bad checkpoint (or a bad place to write) from a tiny
valid Llama checkpoint, runs `prequant convert SOURCE OUTPUT_DIR --device cpu` in a subprocess and checks
what a user sees and what they are left with:

- the exit code (1, or 2 for usage errors);
- exactly one stderr line, `Error: ...`, naming the offending file or tensor and saying what to do;
- no traceback;
- OUTPUT_DIR holds nothing a loader would take for a checkpoint (no config.json, no weights, no index at
  its top level; the hidden staging folder may stay, it is what --resume continues from), files the user
  had there are untouched, and the source was not modified.

Conditions that cannot be faked by editing files are produced for real, never by patching prequant:
permission denied by running the CLI without root's permission-bypassing capabilities, a full disk with
a file-size limit on the process and with a small tmpfs.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import resource
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers import run_cli
from safetensors.torch import load_file, save_file

SHARDED = "100KB"  # gives the tiny Llama three source shards and an index
STAGING = ".prequant-staging"
USER_FILES = {"notes.txt": b"the user's own notes\n", "eval/results.json": b'{"ppl": 7.1}\n'}
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"
DOWN_PROJ = "model.layers.1.mlp.down_proj.weight"
GATE_PROJ = "model.layers.0.mlp.gate_proj.weight"
BF16_NAN, BF16_INF = b"\xc0\x7f", b"\x80\x7f"  # little-endian bfloat16 bit patterns


# --- running the CLI under real-world limits ---------------------------------------------------------


def _drop_dac_capabilities() -> None:
    """preexec_fn: make a root process obey file permission bits, as any user's process does.

    Root reads a chmod 000 file because of CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, not because of its uid;
    dropping both from the bounding set (before exec) gives a root-owned process a user's view of
    permissions while it can still run the interpreter under /root."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, cap_dac_override, cap_dac_read_search = 24, 1, 2
    for cap in (cap_dac_override, cap_dac_read_search):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _as_unprivileged() -> dict:
    """subprocess arguments under which chmod is enforced, or skip the case when that is impossible."""
    if os.geteuid() != 0:
        return {}
    probe = subprocess.run(["true"], preexec_fn=_drop_dac_capabilities, capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip("running as root and cannot drop CAP_DAC_OVERRIDE here, so permissions are not enforced")
    return {"preexec_fn": _drop_dac_capabilities}


def _file_size_limit(limit: int) -> Callable[[], None]:
    """preexec_fn: cap every file the CLI writes at `limit` bytes (RLIMIT_FSIZE).

    Python ignores SIGXFSZ, so a write past the limit fails with EFBIG, as it fails with ENOSPC when the
    disk is full: the same code path, reached for real through the kernel."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


# --- building bad checkpoints --------------------------------------------------------------------


def _read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_safetensors(path: Path, header: dict | bytes, data: bytes, declared: int | None = None) -> None:
    """A safetensors file with the given header (JSON or raw bytes); `declared` overrides the length field."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text) if declared is None else declared) + text + data)


def _edit_header(path: Path, edit: Callable[[dict], None]) -> None:
    header, data = _read_safetensors(path)
    edit(header)
    _write_safetensors(path, header, data)


def _poke(path: Path, tensor: str, value: bytes, element: int = 0) -> None:
    """Overwrite one element of a tensor in place."""
    header, _ = _read_safetensors(path)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    begin = 8 + n + header[tensor]["data_offsets"][0] + element * len(value)
    with open(path, "r+b") as f:
        f.seek(begin)
        f.write(value)


def _retype(path: Path, tensor: str, dtype: torch.dtype) -> None:
    """Store one tensor in another dtype (a valid file: offsets follow)."""
    tensors = load_file(path)
    tensors[tensor] = tensors[tensor].float().clamp(-1, 1).mul(100).to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def _shard_of(src: Path, tensor: str) -> Path:
    return src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _edit_index(src: Path, edit: Callable[[dict], None]) -> None:
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


@dataclass
class Run:
    """What one case runs: `prequant convert source output *args`, with subprocess extras."""

    source: Path
    output: Path
    args: tuple[str, ...] = ()
    popen: dict = field(default_factory=dict)


@dataclass
class Ctx:
    """What a case builder gets: a scratch directory and the valid checkpoints to corrupt copies of."""

    tmp: Path
    single_template: Path
    sharded_template: Path
    finalizers: list[Callable[[], None]]

    def single(self) -> Path:
        return Path(shutil.copytree(self.single_template, self.tmp / "src"))

    def sharded(self) -> Path:
        return Path(shutil.copytree(self.sharded_template, self.tmp / "src"))

    def run(self, source: Path, *args: str, output: Path | None = None, **popen: object) -> Run:
        return Run(source, output or self.tmp / "out", args, dict(popen))


# --- the cases -----------------------------------------------------------------------------------
# Each builder returns what to run; the table below says what must come out of it.


def truncated_shard(c: Ctx) -> Run:
    src = c.single()
    with open(src / "model.safetensors", "r+b") as f:
        f.truncate((src / "model.safetensors").stat().st_size - 100)  # an interrupted download
    return c.run(src)


def header_length_beyond_file(c: Ctx) -> Run:
    src = c.single()
    header, data = _read_safetensors(src / "model.safetensors")
    _write_safetensors(src / "model.safetensors", header, data, declared=10**9)
    return c.run(src)


def header_not_json(c: Ctx) -> Run:
    src = c.single()
    _write_safetensors(
        src / "model.safetensors",
        b'{"lm_head.weight": {"dtype": "BF16", ',
        _read_safetensors(src / "model.safetensors")[1],
    )
    return c.run(src)


def header_not_utf8(c: Ctx) -> Run:
    src = c.single()
    _write_safetensors(src / "model.safetensors", b'{"\xff\xfe": 1}', _read_safetensors(src / "model.safetensors")[1])
    return c.run(src)


def header_not_object(c: Ctx) -> Run:
    src = c.single()
    _write_safetensors(src / "model.safetensors", b"[1, 2, 3]", _read_safetensors(src / "model.safetensors")[1])
    return c.run(src)


def empty_shard(c: Ctx) -> Run:
    src = c.single()
    (src / "model.safetensors").write_bytes(b"")
    return c.run(src)


def offsets_out_of_range(c: Ctx) -> Run:
    src = c.single()

    def edit(h: dict) -> None:
        h[Q_PROJ]["data_offsets"] = [10**6, 10**6 + 8192]  # right size, far past the end of the data

    _edit_header(src / "model.safetensors", edit)
    return c.run(src)


def overlapping_tensors(c: Ctx) -> Run:
    src = c.single()

    def edit(h: dict) -> None:
        h[O_PROJ]["data_offsets"] = list(h[Q_PROJ]["data_offsets"])  # same shape: both claim the same bytes

    _edit_header(src / "model.safetensors", edit)
    return c.run(src)


def offsets_not_matching_shape(c: Ctx) -> Run:
    src = c.single()

    def edit(h: dict) -> None:
        h[Q_PROJ]["shape"] = [64, 63]  # 126 bytes fewer than the offsets span

    _edit_header(src / "model.safetensors", edit)
    return c.run(src)


def unknown_dtype_code(c: Ctx) -> Run:
    src = c.single()

    def edit(h: dict) -> None:
        h[Q_PROJ]["dtype"] = "Q4_K"  # a GGUF type in a safetensors header

    _edit_header(src / "model.safetensors", edit)
    return c.run(src)


def int8_linear_weight(c: Ctx) -> Run:
    src = c.single()
    _retype(src / "model.safetensors", Q_PROJ, torch.int8)
    return c.run(src)


def float8_linear_weight(c: Ctx) -> Run:
    src = c.single()
    _retype(src / "model.safetensors", Q_PROJ, torch.float8_e4m3fn)
    return c.run(src)


def nan_weight(c: Ctx) -> Run:
    src = c.single()
    _poke(src / "model.safetensors", DOWN_PROJ, BF16_NAN, element=777)
    return c.run(src, "--overwrite", output=c.tmp / "existing")


def inf_weight(c: Ctx) -> Run:
    src = c.single()
    _poke(src / "model.safetensors", DOWN_PROJ, BF16_INF, element=5)
    return c.run(src)


def index_not_json(c: Ctx) -> Run:
    src = c.sharded()
    (src / "model.safetensors.index.json").write_text('{"weight_map": {')
    return c.run(src)


def index_names_missing_shard(c: Ctx) -> Run:
    src = c.sharded()
    _shard_of(src, DOWN_PROJ).unlink()  # one shard never arrived
    return c.run(src, "--overwrite", output=c.tmp / "existing")


def index_escapes_source(c: Ctx) -> Run:
    src = c.sharded()
    # A real file there, so the only thing wrong is where the index points.
    shutil.copyfile(_shard_of(src, DOWN_PROJ), c.tmp / "x.safetensors")

    def edit(m: dict) -> None:
        m[DOWN_PROJ] = "../x.safetensors"

    _edit_index(src, edit)
    return c.run(src)


def index_lists_absent_tensor(c: Ctx) -> Run:
    src = c.sharded()

    def edit(m: dict) -> None:
        m["model.layers.2.mlp.down_proj.weight"] = m[DOWN_PROJ]  # a layer no shard holds

    _edit_index(src, edit)
    return c.run(src)


def tensor_in_two_shards(c: Ctx) -> Run:
    src = c.sharded()
    other = next(p for p in sorted(src.glob("model-*.safetensors")) if p != _shard_of(src, DOWN_PROJ))
    tensors = load_file(other)
    tensors[DOWN_PROJ] = load_file(_shard_of(src, DOWN_PROJ))[DOWN_PROJ]  # a stale copy left in another shard
    save_file(tensors, other, metadata={"format": "pt"})
    return c.run(src)


def config_missing(c: Ctx) -> Run:
    src = c.single()
    (src / "config.json").unlink()
    return c.run(src)


def config_not_json(c: Ctx) -> Run:
    src = c.single()
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    return c.run(src)


def already_quantized(c: Ctx) -> Run:
    src = c.single()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (src / "config.json").write_text(json.dumps(config))
    return c.run(src)


def empty_directory(c: Ctx) -> Run:
    (c.tmp / "src").mkdir()
    return c.run(c.tmp / "src")


def source_does_not_exist(c: Ctx) -> Run:
    return c.run(c.tmp / "no-such-model")


def source_is_a_file(c: Ctx) -> Run:
    src = c.single()
    return c.run(src / "model.safetensors")


def output_is_a_file(c: Ctx) -> Run:
    (c.tmp / "out").write_text("not a directory\n")
    return c.run(c.single())


def output_holds_one_file(c: Ctx) -> Run:
    (c.tmp / "out").mkdir()
    (c.tmp / "out" / "notes.txt").write_bytes(USER_FILES["notes.txt"])
    return c.run(c.single())


def output_is_the_source(c: Ctx) -> Run:
    src = c.single()
    # --overwrite would replace the user's original weights with the 4-bit ones: must be refused.
    return c.run(src, "--overwrite", output=src)


def shard_not_readable(c: Ctx) -> Run:
    src = c.sharded()
    _shard_of(src, DOWN_PROJ).chmod(0)
    c.finalizers.append(lambda: _shard_of(src, DOWN_PROJ).chmod(0o644))
    return c.run(src, "--overwrite", output=c.tmp / "existing", **_as_unprivileged())


def config_not_readable(c: Ctx) -> Run:
    src = c.single()
    (src / "config.json").chmod(0)
    c.finalizers.append(lambda: (src / "config.json").chmod(0o644))
    return c.run(src, **_as_unprivileged())


def side_file_not_readable(c: Ctx) -> Run:
    src = c.single()
    # Found only after every shard is written: the latest point a source file can fail.
    (src / "tokenizer_config.json").chmod(0)
    c.finalizers.append(lambda: (src / "tokenizer_config.json").chmod(0o644))
    return c.run(src, "--overwrite", output=c.tmp / "existing", **_as_unprivileged())


def output_parent_not_writable(c: Ctx) -> Run:
    parent = c.tmp / "read-only"
    parent.mkdir()
    parent.chmod(0o555)
    c.finalizers.append(lambda: parent.chmod(0o755))
    return c.run(c.single(), output=parent / "out", **_as_unprivileged())


def disk_full_file_size_limit(c: Ctx) -> Run:
    # 64 KiB lets the staging folder and small files be written (reads are not limited); the 122 KB output
    # shard cannot be.
    return c.run(c.single(), "--overwrite", output=c.tmp / "existing", preexec_fn=_file_size_limit(64 * 1024))


def disk_full_copying_side_files(c: Ctx) -> Run:
    src = c.single()
    # Llama 3's tokenizer.json is 9 MB: the disk can fill after the shards, while the side files are copied.
    (src / "tokenizer.json").write_bytes(b'{"vocab": "' + b"x" * 300_000 + b'"}')
    return c.run(src, "--overwrite", output=c.tmp / "existing", preexec_fn=_file_size_limit(200 * 1024))


def disk_full_tmpfs(c: Ctx) -> Run:
    mnt = c.tmp / "small-disk"
    mnt.mkdir()
    # 96 KiB holds the user's files and the first output shards but not all ~122 KB of them: the disk
    # fills in the middle of the run, after shards were already written.
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}); the RLIMIT_FSIZE case covers it"
        )
    c.finalizers.append(lambda: subprocess.run(["umount", "-l", str(mnt)], check=False))
    out = mnt / "existing"
    return c.run(c.single(), "--overwrite", "--max-shard-size", "40KB", output=out)


def _custom_llama(c: Ctx, **config: int) -> Path:
    """A tiny random bf16 Llama of the given dimensions, saved as one safetensors file."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.bfloat16)
    model.save_pretrained(c.tmp / "src")
    return c.tmp / "src"


def transposed_weight(c: Ctx) -> Run:
    src = c.single()

    def edit(h: dict) -> None:
        h[GATE_PROJ]["shape"] = list(reversed(h[GATE_PROJ]["shape"]))  # same bytes, the model's transpose

    _edit_header(src / "model.safetensors", edit)
    return c.run(src)


def trailing_bytes_after_the_data(c: Ctx) -> Run:
    src = c.single()
    with open(src / "model.safetensors", "ab") as f:
        f.write(b"junk")  # safetensors refuses the file: not fully covered by its tensors
    return c.run(src)


def element_count_overflows(c: Ctx) -> Run:
    src = c.single()

    def edit(h: dict) -> None:
        end = max(e["data_offsets"][1] for k, e in h.items() if k != "__metadata__")
        h["extra"] = {"dtype": "BF16", "shape": [2**33, 2**33, 0], "data_offsets": [end, end]}

    _edit_header(src / "model.safetensors", edit)
    return c.run(src)


def metadata_value_not_a_string(c: Ctx) -> Run:
    src = c.single()

    def edit(h: dict) -> None:
        h["__metadata__"]["step"] = 1000

    _edit_header(src / "model.safetensors", edit)
    return c.run(src)


def skip_is_not_a_regex(c: Ctx) -> Run:
    return c.run(c.single(), "--skip", "(")


def nan_in_a_kept_tensor(c: Ctx) -> Run:
    src = c.single()
    _poke(src / "model.safetensors", "model.norm.weight", BF16_NAN, element=3)
    return c.run(src, "--overwrite", output=c.tmp / "existing")


def odd_element_count_with_bf16_storage(c: Ctx) -> Run:
    # 37 x 98 = 3,626 elements: bitsandbytes' bf16 storage holds 906 words (1,812 bytes) of the 1,813 needed.
    src = _custom_llama(c, hidden_size=98, intermediate_size=37, num_hidden_layers=1, num_attention_heads=1,
                        num_key_value_heads=1, vocab_size=64)
    return c.run(src)


def disk_full_in_the_journal(c: Ctx) -> Run:
    # Every file but the journal stays under the 6 KiB limit (shards of at most 2 KB): the run fails on a
    # journal line, the only write there is no room for.
    src = _custom_llama(c, hidden_size=16, intermediate_size=32, num_hidden_layers=6, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=32)
    return c.run(src, "--max-shard-size", "2KB", preexec_fn=_file_size_limit(6 * 1024))


@dataclass(frozen=True)
class Case:
    build: Callable[[Ctx], Run]
    exit_code: int
    names: str  # the file, tensor or path the message must name; {source} and {output} are the run's paths
    says: tuple[str, ...]  # what went wrong and what to do, as substrings of the message

    @property
    def id(self) -> str:
        return self.build.__name__


REDOWNLOAD = "re-download"
AGAIN = "run the same command again"  # what a failure that leaves work to continue says
CASES = [
    Case(truncated_shard, 1, "model.safetensors", ("truncated", REDOWNLOAD)),
    Case(header_length_beyond_file, 1, "model.safetensors", ("header length", REDOWNLOAD)),
    Case(header_not_json, 1, "model.safetensors", ("not valid JSON", REDOWNLOAD)),
    Case(header_not_utf8, 1, "model.safetensors", ("not valid JSON", REDOWNLOAD)),
    Case(header_not_object, 1, "model.safetensors", ("not a JSON object", REDOWNLOAD)),
    Case(empty_shard, 1, "model.safetensors", ("too short", REDOWNLOAD)),
    Case(offsets_out_of_range, 1, Q_PROJ, ("past the end", REDOWNLOAD)),
    Case(overlapping_tensors, 1, O_PROJ, ("overlap", Q_PROJ, REDOWNLOAD)),
    Case(offsets_not_matching_shape, 1, Q_PROJ, ("do not match", REDOWNLOAD)),
    Case(unknown_dtype_code, 1, Q_PROJ, ("Q4_K", "not supported", "bf16")),
    Case(int8_linear_weight, 1, Q_PROJ, ("I8", "only F32, F16 and BF16", "--skip")),
    Case(float8_linear_weight, 1, Q_PROJ, ("F8_E4M3", "only F32, F16 and BF16", "--skip")),
    Case(nan_weight, 1, DOWN_PROJ, ("NaN or Inf", "--skip model.layers.1.mlp.down_proj")),
    Case(inf_weight, 1, DOWN_PROJ, ("NaN or Inf", "fix the source")),
    Case(index_not_json, 1, "model.safetensors.index.json", ("not a valid index", REDOWNLOAD)),
    Case(index_names_missing_shard, 1, "model-00002-of-00003.safetensors", ("missing", "download")),
    Case(index_escapes_source, 1, "../x.safetensors", ("outside", "index")),
    Case(index_lists_absent_tensor, 1, "model.layers.2.mlp.down_proj.weight", ("no shard holds it", REDOWNLOAD)),
    Case(tensor_in_two_shards, 1, DOWN_PROJ, ("in both", "remove the stale shard")),
    Case(config_missing, 1, "config.json", ("missing", "put the model's config.json next to its weights")),
    Case(config_not_json, 1, "config.json", ("not valid JSON", "fix or re-download")),
    Case(already_quantized, 1, "config.json", ("already quantized", "original")),
    Case(empty_directory, 1, "{source}", ("no model weights found", "pass the directory")),
    Case(source_does_not_exist, 1, "{source}", ("does not exist", "pass a local checkpoint directory")),
    Case(source_is_a_file, 1, "{source}", ("is a file", "pass the checkpoint's directory")),
    Case(output_is_a_file, 2, "{output}", ("is a file", "choose a directory")),
    Case(output_is_the_source, 2, "{output}", ("source", "choose another OUTPUT_DIR")),
    Case(output_holds_one_file, 2, "{output}", ("is not empty (it holds notes.txt)", "pass --overwrite")),
    Case(shard_not_readable, 1, "model-00002-of-00003.safetensors", ("permission denied", "make it readable")),
    Case(config_not_readable, 1, "config.json", ("permission denied", "make it readable")),
    Case(side_file_not_readable, 1, "tokenizer_config.json", ("cannot read", "make it readable")),
    Case(output_parent_not_writable, 1, "{output}", ("permission denied", "writable")),
    Case(disk_full_file_size_limit, 1, "model.safetensors", ("no space left", "free space", AGAIN)),
    Case(disk_full_copying_side_files, 1, "tokenizer.json", ("no space left", "free space", AGAIN)),
    Case(disk_full_tmpfs, 1, "model-0000", ("no space left", "free space", AGAIN)),
    Case(disk_full_in_the_journal, 1, "journal.jsonl", ("no space left", "free space", AGAIN)),
    Case(transposed_weight, 1, GATE_PROJ, ("has shape [64, 128]", "expects [128, 64] (it is stored transposed)",
                                           "config.json")),
    Case(trailing_bytes_after_the_data, 1, "model.safetensors", ("4 bytes follow the last tensor", REDOWNLOAD)),
    Case(element_count_overflows, 1, "'extra'", ("more elements than a 64-bit count holds", REDOWNLOAD)),
    Case(metadata_value_not_a_string, 1, "'step'", ("not a string", REDOWNLOAD)),
    Case(skip_is_not_a_regex, 2, "--skip '('", ("not a valid regular expression", "escape")),
    Case(nan_in_a_kept_tensor, 1, "model.norm.weight", ("1 NaN", "kept unquantized", "--allow-nan")),
    Case(odd_element_count_with_bf16_storage, 1, "model.layers.0.mlp.down_proj.weight",
         ("3,626 elements", "byte short", "--quant-storage uint8")),
]


# --- the test ------------------------------------------------------------------------------------


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` with the sha256 of its bytes (tiny trees only)."""
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    if not root.exists():
        return {}
    snap = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and STAGING not in p.parts and os.access(p, os.R_OK) and p.stat().st_mode & 0o444:
            snap[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


def _looks_like_a_checkpoint(names: set[str]) -> set[str]:
    return {n for n in names if n == "config.json" or n.endswith((".safetensors", ".index.json", ".bin"))}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_refused_cleanly(case: Case, checkpoints, tmp_path: Path) -> None:
    ctx = Ctx(tmp_path, checkpoints("llama"), checkpoints("llama", SHARDED), [])
    try:
        run = case.build(ctx)
        # Cases that write into an existing OUTPUT_DIR (with --overwrite) seed it with the user's own files.
        seeded = "--overwrite" in run.args and run.output != run.source
        if seeded:
            for rel, content in USER_FILES.items():
                (run.output / rel).parent.mkdir(parents=True, exist_ok=True)
                (run.output / rel).write_bytes(content)
        out_before = _snapshot(run.output)
        source_before = _snapshot(run.source)

        # PREQUANT_DEBUG="" so that a developer's own setting cannot turn the one-line errors into tracebacks.
        proc = run_cli(
            "convert",
            str(run.source),
            str(run.output),
            "--device",
            "cpu",
            *run.args,
            env={"PREQUANT_DEBUG": ""},
            **run.popen,
        )

        assert proc.returncode == case.exit_code, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.stdout == "", proc.stdout  # stdout is for results; a failed run has none
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
        message = lines[0]
        assert case.names.format(source=run.source, output=run.output) in message, message
        for phrase in case.says:
            assert phrase in message, f"{phrase!r} not in {message!r}"

        # Nothing was written into the source (or, for the output-is-a-file case, over that file).
        assert _snapshot(run.source) == source_before
        if run.output.is_file():
            assert _snapshot(run.output) == out_before
        elif run.output.is_dir() and run.output != run.source:
            top = {p.name for p in run.output.iterdir()}
            assert not _looks_like_a_checkpoint(top), top
            # Only the user's files and the hidden staging folder (kept for --resume) are there.
            assert top <= {rel.split("/")[0] for rel in USER_FILES} | {STAGING}, top
            if seeded:
                assert _snapshot(run.output) == out_before
    finally:
        for undo in reversed(ctx.finalizers):
            undo()


def test_symlinked_shards_like_the_hub_cache_are_accepted(checkpoints, tmp_path: Path) -> None:
    """The Hub cache's snapshot folders hold symlinks into ../../blobs: not an escape, a normal source."""
    template = checkpoints("llama", SHARDED)
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in template.iterdir():
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    proc = run_cli("convert", str(snapshot), str(tmp_path / "out"), "--device", "cpu", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "out").exists()
    # A real conversion through the links gives the bytes of the same source held as plain files; the card names
    # the cached repo as the base model.
    plain = tmp_path / "plain-source" / snapshot.name
    shutil.copytree(template, plain)
    assert not any(p.is_symlink() for p in plain.iterdir()) and all(p.is_symlink() for p in snapshot.iterdir())
    results = {}
    linked, plain_out = tmp_path / "out-linked", tmp_path / "out-plain"
    for name, src, out in (("linked", snapshot, linked), ("plain", plain, plain_out)):
        proc = run_cli("convert", str(src), str(out), "--device", "cpu", "--json")
        assert proc.returncode == 0, proc.stderr
        results[name] = json.loads(proc.stdout)
    for key in ("tensors_quantized", "tensors_kept", "shards", "input_bytes", "output_bytes", "unquantized_parameters"):
        assert results["linked"][key] == results["plain"][key], key
    assert results["linked"]["tensors_quantized"] == 14 and results["linked"]["tensors_kept"] == 7
    files = sorted(p.name for p in linked.iterdir())
    assert files == sorted(p.name for p in plain_out.iterdir())
    assert {"model.safetensors", "config.json", "README.md", "prequant.json"} <= set(files)  # one output shard
    for f in files:
        if f not in ("prequant.json", "README.md"):  # they record the source's path and name
            assert (linked / f).read_bytes() == (plain_out / f).read_bytes(), f
    assert "base_model: org/tiny" in (linked / "README.md").read_text()
    ours, theirs = (json.loads((d / "prequant.json").read_text()) for d in (linked, plain_out))
    ours["files"].pop("README.md"), theirs["files"].pop("README.md")
    assert ours["files"] == theirs["files"]  # every other output file's size and sha256


def test_errors_show_a_traceback_with_prequant_debug(tmp_path: Path) -> None:
    """The one-line form is for users; PREQUANT_DEBUG=1 gives developers the traceback."""
    proc = run_cli("convert", str(tmp_path / "missing"), str(tmp_path / "out"), env={"PREQUANT_DEBUG": "1"})
    assert proc.returncode != 0
    assert proc.returncode == 1  # the interpreter's status for an uncaught exception, not the error's own code
    assert "Traceback" in proc.stderr and "PrequantError" in proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]  # the exception, last, as Python prints it
    assert last.startswith(f"prequant.errors.PrequantError: source '{tmp_path / 'missing'}' does not exist"), last


assert len({c.id for c in CASES}) == len(CASES) >= 15


def test_source_cut_short_after_the_scan_is_an_error_not_a_bus_error(checkpoints, tmp_path):
    """A memory-mapped tensor past a file's new end would SIGBUS when read; it is refused, naming file and tensor."""
    from prequant.checkpoint import reader
    from prequant.errors import PrequantError

    src = tmp_path / "src"
    shutil.copytree(checkpoints("llama"), src)
    shard = src / "model.safetensors"
    refs = reader.scan_files([shard])
    last = max(refs, key=lambda r: r.offset + r.nbytes)
    with reader.TensorReader() as data:
        data.view(refs[0])  # mapped while the file is whole
        os.truncate(shard, last.offset + 1)
        with pytest.raises(PrequantError) as error:
            data.view(last)
    message = str(error.value)
    assert str(shard) in message and repr(last.name) in message and "\n" not in message
