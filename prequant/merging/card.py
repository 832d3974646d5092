"""A merge's model card (README.md): what was merged into what, by which rule, and in which dtype or 4-bit settings.
The base's own card is carried below it (its licence metadata too), as a conversion's card carries its source's."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.hf_files import CARD
from ..conversion.card import _CARRIED, _original_card, base_model_id
from ..conversion.plan import Plan
from ..source.spec import Source
from .adapter import Adapter


def write(staging: Path, src: Source, identity: dict, adapter: Adapter, plan: Plan, quantize: bool,
          repo_id: str | None) -> None:
    """Write README.md into `staging`: the base, the adapter, the rule and the output's format."""
    from huggingface_hub import ModelCard, ModelCardData

    base = base_model_id(identity, src.path)
    original = _original_card(src.path / CARD)
    extra = {k: v for k, v in (original or {}).get("metadata", {}).items() if k in _CARRIED}
    ad = adapter.identity
    ad_name = ad.get("repo_id") or Path(ad.get("path") or ad["spec"]).name
    s = plan.settings
    fmt = (f"4-bit bitsandbytes ({s.quant_type}, blocksize {s.blocksize}, double quant "
           f"{'on' if s.double_quant else 'off'}, storage {s.quant_storage})" if quantize
           else "16-bit, in the base's dtypes")
    data = ModelCardData(library_name="transformers", tags=["prequant", "lora", "merged"],
                         **({"base_model": base, "base_model_relation": "finetune"} if base else {}), **extra)
    base_shown = f"[`{base}`](https://huggingface.co/{base})" if base else f"`{Path(identity['path']).name}`"
    adapter_shown = (f"[`{ad_name}`](https://huggingface.co/{ad_name})" if ad.get("repo_id") else f"`{ad_name}`")
    revision = f" at commit `{ad['commit']}`" if ad.get("commit") else ""
    targets = sum(1 for st in plan.steps if st.decision.reason.startswith("merged"))
    lines = [
        f"# {repo_id or ad_name + '-merged'}", "",
        (f"{base_shown} with the LoRA adapter {adapter_shown}{revision} merged into it by "
         f"`prequant merge`: {targets} tensors changed, stored {fmt}."), "",
        ("Each targeted weight is `W + (B @ A) * scaling` computed in float32 and rounded once to the output dtype "
         "(DoRA: `(m / ||W + dW||) * (W + dW)`); modules_to_save replace their tensors whole."), "",
    ]
    if original:
        lines += ["## The base's model card", "", original["text"]]
    (staging / CARD).write_text(str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))))
