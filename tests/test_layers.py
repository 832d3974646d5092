"""The package's house rules, read from the code: no import cycles (lazy and type-checking imports included) and
no lower layer importing an upper one.

Every `import` and `from ... import` of every module is read with `ast` (inside functions and `if TYPE_CHECKING:`
blocks too, since those are real dependencies), resolved to the prequant module it names, and checked against
`LAYERS`. A failure names the importing file, the line and the module imported.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "prequant"

# Bottom to top. A module may import its own part, and any part of a lower layer; parts of one layer are
# independent of each other. (The package face, prequant/__init__.py, is the top, with the CLI.)
LAYERS: list[set[str]] = [
    {"prequant.errors", "prequant._version", "prequant.settings"},
    {"prequant.util"},
    {"prequant.checkpoint", "prequant.hub"},
    {"prequant.bnb"},
    {"prequant.source"},
    {"prequant.verify", "prequant.fsdp"},
    {"prequant.conversion"},
    {"prequant.merging"},
    {"prequant.cli", "prequant"},
    {"prequant.__main__"},
]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str], *, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, prequant module) for each import in the file (resolved against `known`: `from a import b` names
    module a.b when that is a module, else a)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "prequant"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "prequant":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in known else target))
    return found


def part(module: str) -> str:
    """The layer part a module belongs to: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def layer(module: str) -> int:
    p = part(module)
    for i, names in enumerate(LAYERS):
        if p in names:
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add its part ({p}) to LAYERS")


def graph() -> dict[str, list[tuple[int, str]]]:
    mods = modules()
    known = set(mods)
    return {name: [(line, m) for line, m in imports(path, known) if m in known and m != name]
            for name, path in mods.items()}


def test_every_module_is_in_a_layer():
    for name in modules():
        layer(name)


def test_no_lower_layer_imports_an_upper_one_and_parts_of_a_layer_are_independent():
    mods = modules()
    bad = []
    for name, edges in graph().items():
        for line, target in edges:
            if part(target) == part(name) or (part(name) == "prequant" and name == "prequant"):
                continue
            if layer(target) >= layer(name):
                bad.append(f"{mods[name].relative_to(ROOT)}:{line} imports {target} (layer {layer(target)}, "
                           f"not below {part(name)}'s {layer(name)})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_lazy_and_type_checking_imports_included():
    edges = {name: sorted({m for _, m in e}) for name, e in graph().items()}
    # A package's face (__init__.py) runs before each of its submodules: `import a.b` imports `a` first. That is
    # not an import `a` makes of `a.b`, so it is no edge; what the face itself imports is.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_what_the_cli_runs_before_torch_imports_no_heavy_library(tmp_path):
    """The CLI checks OUTPUT_DIR and starts reading a local source ahead before it imports torch (for a merge, the
    adapter's weights and the base its config names, and it hashes the adapter): its own module, that check, that
    read-ahead and that hash, run here in a fresh interpreter on a real checkpoint directory (sharded, with an
    index) and adapter folder, must load neither torch nor transformers nor huggingface_hub (each costs seconds of
    start-up), and the hash must be the file's."""
    src, out, adapter = tmp_path / "ckpt", tmp_path / "out", tmp_path / "adapter"
    src.mkdir()
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(src)}))
    (adapter / "adapter_model.safetensors").write_bytes(b"x" * 4096)
    (src / "config.json").write_text("{}")
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (src / name).write_bytes(b"x" * 4096)
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    code = (
        "import sys\n"
        "import prequant.cli\n"
        "from prequant.conversion import output, readahead\n"
        f"output.target({str(out)!r}, {str(src)!r}, overwrite=False, resume=False)\n"
        f"readahead.prefetch({str(src)!r})\n"
        "from prequant.merging import folder\n"
        f"weights, base = folder.peek({str(adapter)!r})\n"
        f"assert weights == [folder.Path({str(adapter / 'adapter_model.safetensors')!r})] and base == {str(src)!r}\n"
        "readahead.prefetch(base, first=weights)\n"
        f"folder.hash_ahead({str(adapter)!r})\n"
        "import hashlib\n"
        f"digest = folder.sha256(folder.Path({str(adapter / 'adapter_model.safetensors')!r}))\n"
        "assert digest == hashlib.sha256(b'x' * 4096).hexdigest(), digest\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'huggingface_hub', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"imported before torch should be: {proc.stdout.strip()}"


def test_a_local_conversion_imports_huggingface_hub_only_to_write_the_card():
    """huggingface_hub costs 0.3 s of imports: `convert()`'s modules load without it (the card's classes are
    imported on a thread of their own once the stream has begun, `card.import_ahead`)."""
    code = ("import sys\nimport prequant.conversion.run, prequant.cli\n"
            "print('huggingface_hub' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
