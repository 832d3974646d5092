"""The output's model card (README.md), written with huggingface_hub's ModelCard / ModelCardData.

It says what the checkpoint is (base model, 4-bit settings, what stayed unquantized), how to load it with each
consumer (transformers 5, transformers 4.x, FSDP+QLoRA, vLLM/SGLang: what each needs depends on the quant
storage), how it was verified, and carries the source's own card: its text under "Original model card" and its
licence metadata in the new YAML header. Nothing of the original card is dropped: a header that does not parse
is kept verbatim in a code block. `change_storage` rewrites the storage-dependent parts of a card it wrote.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from .._version import __version__
from ..bnb.stats import expected_rel_error
from ..checkpoint import quantized
from ..checkpoint.hf_files import CARD, cache_repo_dir, read_config
from ..errors import PrequantError
from ..source.spec import is_repo_id
from .plan import Plan

# Metadata of the source card carried into the new one: licence terms (and the gate that makes users
# accept them), and facts about the model that quantization does not change.
_CARRIED = ("license", "license_name", "license_link", "language", "pipeline_tag", "datasets")
_CARRIED_PREFIXES = ("license", "extra_gated")


def import_ahead() -> None:
    """Import huggingface_hub's card classes on a thread of their own while the stream runs, so that the card does
    not wait for them at the end, where the import competes for the interpreter with the threads hashing the last
    shards and holds up the output's publication."""
    threading.Thread(target=_import_card_classes, name="prequant-card-import", daemon=True).start()


def _import_card_classes() -> None:
    try:
        from huggingface_hub import ModelCard, ModelCardData  # noqa: F401 - imported now, used by write_card
    except Exception:  # noqa: BLE001, S110 - write_card's own import reports it
        pass


def write_card(
    staging: Path,
    *,
    source_dir: Path,
    source: dict,
    base_model: str | None,
    plan: Plan,
    stats_summary: dict | None,
    repo_id: str | None = None,
) -> str | None:
    """Write README.md into `staging`; return the base model it names (None: it names none).

    `source`: the manifest's record of the source (`record.source_identity`); `base_model`: the one the user named
    (--base-model), else the Hub repo prequant can tell (`base_model_id`), else none: the metadata then has no
    base_model (a folder's name is no Hub link) and the text names the source folder. The loading examples name
    `repo_id` when the destination is known (--push-to-hub), else a name derived from the base model or folder:
    never the local output path, so that converting the same source with the same options gives the same bytes
    wherever the output goes."""
    from huggingface_hub import ModelCard, ModelCardData  # imported ahead (`import_ahead`), not on the start-up

    base = base_model or base_model_id(source, source_dir)
    original = _original_card(source_dir / CARD)
    s = plan.settings
    tags = ["bitsandbytes", "4-bit", s.quant_type, "prequant"]
    extra = dict(original["metadata"]) if original else {}
    tags += [t for t in extra.pop("tags", None) or [] if isinstance(t, str) and t not in tags]
    linked = {"base_model": base, "base_model_relation": "quantized"} if base else {}
    data = ModelCardData(
        library_name="transformers",
        tags=tags,
        **linked,
        **{k: v for k, v in extra.items() if k not in ("base_model", "library_name", "base_model_relation")},
    )
    shown = base or Path(source["path"]).resolve().name
    name = repo_id or f"{shown.split('/')[-1]}-bnb-4bit-{s.quant_type}"
    body = _body(name, repo_id is not None, shown, base is not None, plan, stats_summary, original)
    (staging / CARD).write_text(str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")))
    return base


def base_model_id(source: dict, source_dir: Path) -> str | None:
    """The source's Hub repo id when prequant can tell it: a Hub source's; that of a snapshot folder of the Hugging
    Face cache given as a local path (`.../models--org--name/snapshots/<commit>`); config.json's `_name_or_path`
    when it is a repo id (`org/name`) or such a snapshot path. None otherwise."""
    if source.get("repo_id"):
        return source["repo_id"]
    try:
        named = read_config(source_dir).get("_name_or_path")
    except PrequantError:  # the conversion read it already; trouble now just means no name from it
        named = None
    for path in (source["path"], named):
        if found := _cache_repo(path):
            return found
    return named if isinstance(named, str) and is_repo_id(named) else None  # not a local path: ./x, /x/y, ~/x


def _cache_repo(path: object) -> str | None:
    """org/name from a Hugging Face cache snapshot path (`.../models--org--name/snapshots/<commit>`), else None."""
    if not isinstance(path, str) or (repo := cache_repo_dir(path)) is None:
        return None
    org, sep, name = repo.name.removeprefix("models--").partition("--")
    return f"{org}/{name}" if sep and org and name else None


def base_model_note(manifest: dict, option: str) -> str | None:
    """The hint for an output whose card names no base model (as its `manifest` records): pass `option` (as the
    caller writes it, e.g. `--base-model org/name`). None when the card names one, or the manifest predates the
    record."""
    source = manifest.get("source") or {}
    if "base_model" not in source or source["base_model"]:
        return None
    return (f"the model card names no base_model: prequant cannot tell which Hub repo {Path(source['path']).name} "
            f"comes from; to link the card to it, convert with {option}")


def _original_card(path: Path) -> dict | None:
    """The source card split into carried metadata and text; None when the source has no README.md."""
    if not path.is_file():
        return None
    from huggingface_hub import ModelCard

    raw = path.read_text(encoding="utf-8", errors="replace")
    try:
        card = ModelCard(raw, ignore_metadata_errors=True)
    except Exception:  # noqa: BLE001 - any YAML error: keep everything as text instead
        return {"metadata": {}, "text": raw, "unparsed_header": True}
    meta = card.data.to_dict()
    carried = {k: v for k, v in meta.items() if k in _CARRIED or k.startswith(_CARRIED_PREFIXES) or k == "tags"}
    return {"metadata": carried, "text": card.text, "unparsed_header": False}


def _body(
    name: str, known: bool, base: str, base_is_repo: bool, plan: Plan, summary: dict | None, original: dict | None
) -> str:
    s = plan.settings
    base_ref = f"[`{base}`](https://huggingface.co/{base})" if base_is_repo else f"`{base}`"
    dq = "with double quantization" if s.double_quant else "without double quantization"
    fused = plan.fused_experts_note()
    lines = [
        f"# {name}",
        "",
        (f"{base_ref} pre-quantized to bitsandbytes 4-bit **{s.quant_type.upper()}** ({dq}, block size "
        f"{s.blocksize}) with prequant {__version__}. It holds exactly what "
        + ("transformers 4.x saves after quantizing on load with the same `BitsAndBytesConfig`, MoE experts "
           "included" if plan.quantize_experts else "transformers saves after quantizing on load with the same "
           "`BitsAndBytesConfig`") + ", so it loads with no quantization arguments."),
        "",
        *([note, ""] if (note := quantized.card_note(st.source for st in plan.steps)) else []),
        *([f"**{fused[0].upper()}{fused[1:]}.**", ""] if fused else []),
        "## Quantization",
        "",
        "| setting | value |",
        "|---|---|",
        f"| `bnb_4bit_quant_type` | `{s.quant_type}` |",
        f"| `bnb_4bit_use_double_quant` | `{s.double_quant}` |",
        f"| block size | {s.blocksize} |",
        f"| `bnb_4bit_compute_dtype` | `{s.compute_dtype}` |",
        _storage_row(s.quant_storage),
        f"| `llm_int8_skip_modules` | {_skip_text(plan.skip_modules)} |",
        (f"| tensors quantized / kept | {sum(st.quantize for st in plan.steps)} / "
        f"{sum(not st.quantize for st in plan.steps)} |"),
        "",
        "Left unquantized (original dtype):",
        "",
        *[f"- {n:,} parameters ({why})" for why, n in plan.unquantized().items()],
        "",
        *loading_section(name, known, s.quant_storage, s.compute_dtype, fused is not None and not plan.quantize_experts,
                         plan.quantize_experts),
        "## Verification",
        "",
        ("`prequant.json` lists the size and sha256 of every file, the source, the versions and options used, "
        "and per-tensor statistics. `prequant verify DIR` checks the files against it, the index against the "
        "shards, every quantized tensor's companions and quant state, and `config.json`; with "
        "`--source ORIGINAL` it also measures each tensor's error against the original weights."),
        "",
        *_stats_lines(summary, expected_rel_error(s.quant_type, s.blocksize), s.quant_type.upper()),
    ]
    if original is not None:
        lines += ["## Original model card", ""]
        if original["unparsed_header"]:
            lines += ["(The original card's metadata header did not parse; the card follows verbatim.)", ""]
            lines += ["````markdown", original["text"].rstrip(), "````"]
        else:
            lines.append(original["text"].strip())
    return "\n".join(lines).rstrip() + "\n"


def _skip_text(skip: list[str] | None) -> str:
    if skip is None:
        return "transformers' defaults"
    return ", ".join(f"`{m}`" for m in skip) or "none"


def _storage_row(storage: str) -> str:
    return f"| `bnb_4bit_quant_storage` | `{storage}` |"


_LOADING = "## How to load"
_STANDS_FOR = "stands for this checkpoint's Hub repo id or local folder."
_FUSED_ONLY = "With its experts unquantized, this checkpoint loads in transformers 5 only"
_EXPERTS = "prequant.load_model"


def loading_section(name: str, known: bool, storage: str, compute: str, fused: bool,
                    experts: bool = False) -> list[str]:
    """"How to load" for each consumer; what each needs depends on the quant storage (and MoE experts: fused and
    kept by transformers 5, or 4-bit one per expert with --quantize-experts)."""
    lines = [_LOADING, ""]
    if not known:
        lines += [f"`{name}` {_STANDS_FOR}", ""]
    if experts:
        lines += [("**transformers 5** fuses MoE experts into 3-D parameters, which cannot hold these 4-bit experts "
                   "(its `from_pretrained` refuses this checkpoint with a size mismatch); `prequant.load_model` "
                   "builds the model with one 4-bit linear per expert, on GPU or CPU (`pip install prequant`):"), "",
                  "```python", "import prequant", "",
                  f'model = prequant.load_model("{name}", device_map="auto")', "```", ""]
        compute_or_storage = compute if storage == "uint8" else storage
        return lines + [(f"**transformers 4.x** (tested with 4.57) builds experts as `nn.Linear` layers and loads "
                         f"this checkpoint as it is; pass `dtype` (`{compute_or_storage}`):"), "",
                        *_snippet(name, compute_or_storage),
                        ("**FSDP+QLoRA**: `prequant.load_for_fsdp` loads it sharded, one 4-bit linear per expert, "
                         "and LoRA can target the experts' projections as well as attention."), ""]
    lines += ["**transformers 5**:", "", *_snippet(name, None)]
    if fused:
        lines += [(f"{_FUSED_ONLY}: transformers 4.x builds those experts as 4-bit `Linear4bit` layers and vLLM "
                   "and SGLang as 4-bit fused experts, and none of them finds 4-bit weights for them here."), ""]
    if storage == "uint8":
        if not fused:
            lines += [(f"**transformers 4.x** (tested with 4.57): give the dtype to compute in (`{compute}`); the "
                       "packed weights are `uint8`, which no dtype casts:"), "", *_snippet(name, compute)]
        lines += [("**FSDP+QLoRA**: FSDP shards the packed weights together with the other parameters only when "
                   "they are stored as the training dtype; make a copy stored that way, with the same packed bytes: "
                   "`prequant change-storage DIR DIR-bf16 --quant-storage bfloat16`."), ""]
        if not fused:
            lines += ["**vLLM** (and SGLang, whose bitsandbytes support is adapted from vLLM's) read this checkpoint "
                      "as it is (`bnb_4bit_quant_storage` is `uint8`, which both require):", "", "```python",
                      "from vllm import LLM", "", f'llm = LLM(model="{name}", quantization="bitsandbytes")', "```",
                      "", f"or `vllm serve {name} --quantization bitsandbytes`.", ""]
        return lines
    who = "FSDP+QLoRA" if fused else "transformers 4.x** (tested with 4.57) **and FSDP+QLoRA"
    lines += [(f"**{who}**: pass `dtype` equal to the quant storage (`{storage}`, as `bnb_4bit_quant_storage` in "
               "`config.json` says), so that FSDP shards the packed 4-bit weights together with the other parameters"
               + ("" if fused else f"; without it transformers 4.x loads the model in float16 and casts the "
                  f"{storage}-stored packed weights as numbers, which corrupts them") + ":"), "",
              *_snippet(name, storage)]
    if not fused:
        lines += [("**vLLM and SGLang** read bitsandbytes checkpoints only with `uint8` storage; make a copy stored "
                   "that way, with the same packed bytes: `prequant change-storage DIR DIR-uint8 --quant-storage "
                   "uint8`."), ""]
    return lines


def _snippet(name: str, dtype: str | None) -> list[str]:
    imports = ["import torch"] if dtype else []
    dtype_arg = f", dtype=torch.{dtype}" if dtype else ""
    return ["```python", *imports, "from transformers import AutoModelForCausalLM", "",
            f'model = AutoModelForCausalLM.from_pretrained("{name}", device_map="auto"{dtype_arg})', "```", ""]


def change_storage(text: str, old: str, new: str, compute: str) -> str | None:
    """A card this module wrote, for the same checkpoint stored as `new` instead of `old`: the storage row and the
    "How to load" section rewritten, the rest unchanged. None when the card is not one of ours as written (edited)."""
    row = _storage_row(old)
    heading = re.search(r"^# (.+)$", text, re.MULTILINE)
    start = text.find("\n" + _LOADING + "\n")
    end = text.find("\n## ", start + 1) if start >= 0 else -1
    if text.count(row) != 1 or heading is None or end < 0:
        return None
    name = heading.group(1)
    section = text[start + 1:end + 1]
    lines = loading_section(name, _STANDS_FOR not in section, new, compute, _FUSED_ONLY in section,
                            _EXPERTS in section)
    return text[:start + 1].replace(row, _storage_row(new)) + "\n".join(lines) + text[end:]


def _stats_lines(summary: dict | None, expected: float, quant_type: str) -> list[str]:
    if not summary or not summary.get("tensors"):
        return ["Per-tensor error statistics were not recorded for this conversion.", ""]
    return [
        (f"Measured during conversion, dequantized against the original weights ({summary['tensors']} quantized "
        f"tensors): relative L2 error median {summary['median_rel_error']}, max {summary['max_rel_error']} "
        f"(`{summary['max_rel_error_tensor']}`); {quant_type} at this block size gives about {expected} on "
        "Gaussian-like weights."),
        "",
    ]
