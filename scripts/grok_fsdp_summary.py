"""summary.md of scripts/grok_fsdp_check.sh: per rank of each check-fsdp report (load seconds, RssAnon, RssFile,
the checkpoint bytes its shards hold, losses, packed bytes intact), and, derived from those figures (not measured),
what a real Grok-1 (64 layers) needs per GPU on an 8-GPU node with load_for_fsdp.

    python3 scripts/grok_fsdp_summary.py OUT_DIR     # reads plan.json, check-prequant.json, check-trainer.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

G = 2**30
SFT_LOSS_RTOL = 1e-6  # prequant.fsdp.check.SFT_LOSS_RTOL: TRL's loss kernel against the model's own loss
GROK_LAYERS = 64


def run_table(name: str, r: dict) -> tuple[list[str], dict | None]:
    lines = [f"\n## {name}: {r['checkpoint']} on {r['nproc']} gloo ranks (CPU); check-fsdp ok: {r['ok']}"]
    run = next(iter(r["runs"].values()))
    s = run.get("summary")
    if not s:
        return lines + [f"failed: {run.get('error')}"], None
    lim = run["limits"]
    weights = sum(x["load"].get("checkpoint_bytes_held") or 0 for x in run["ranks"])  # the shards tile the weights once
    lines += ["| rank | load s | peak RssAnon load GiB | RssAnon load - shards GiB | peak RssAnon train GiB | "
              "peak RssFile load GiB | RssFile at start GiB | checkpoint bytes in its shards GB (share of the weights) | "
              "losses | packed bytes intact |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in run["ranks"]:
        ld, tr, p = x["load"], x["train"], x["packed"]
        held = ld.get("checkpoint_bytes_held") or 0
        intact = p["mismatched_at_rest"] == 0 and p["mismatched_in_forward"] == 0 and p["checked_in_forward"] >= p["tensors"]
        lines.append(f"| {x['rank']} | {ld['seconds']:.1f} | {ld['peak_rss_anon'] / G:.2f} | "
                     f"{(ld['peak_rss_anon'] - held) / G:.2f} | {tr['peak_rss_anon'] / G:.2f} | {ld['peak_rss_file'] / G:.2f} | "
                     f"{ld.get('at_start_rss_file', 0) / G:.2f} | {held / 1e9:.3f} ({held / max(weights, 1):.4f}) | "
                     f"{' '.join(f'{v:.6f}' for v in x['losses'])} | {'yes' if intact else 'NO'} ({p['bytes'] / 1e9:.2f} GB) |")
    lines.append(f"\nsteps {len(s['losses'])}, train {max(x['train']['seconds'] for x in run['ranks']):.0f} s; problems: "
                 f"{s['problems'] or 'none'}; {s['packed_tensors']} packed tensors, {s['nan_patterns']} bf16-NaN patterns; "
                 f"checkpoint {lim['checkpoint'] / 1e9:.2f} GB ({weights / 1e9:.2f} GB of weights in the ranks' shards; the "
                 f"quant states, complete on every rank, aside), largest layer {lim['largest_layer'] / G:.2f} GiB. On the "
                 "CPU a rank's shards are its own anonymous memory: 'RssAnon load - shards' is what the 2 GiB limit "
                 "(for GPU ranks, whose shards are on the GPU) bounds.")
    return lines, run


def main(out: Path) -> None:
    lines = ["# Grok-1-shaped checkpoint, 8 FSDP ranks (scripts/grok_fsdp_check.sh)"]
    plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").is_file() else {}
    lines.append(f"plan: {json.dumps(plan)}")
    runs = {}
    for loader in ("prequant", "trainer"):
        p = out / f"check-{loader}.json"
        if not p.is_file():
            lines.append(f"\n## {loader}: no report")
            continue
        table, run = run_table(loader, json.loads(p.read_text()))
        lines += table
        if run:
            runs[loader] = run
    if len(runs) == 2:
        a, b = runs["prequant"]["summary"]["losses"][0], runs["trainer"]["summary"]["losses"][0]
        agree = math.isclose(a, b, rel_tol=SFT_LOSS_RTOL, abs_tol=0)
        lines.append(f"\nfirst-step loss: prequant {a:.8f}, trainer {b:.8f}: "
                     f"{'agree' if agree else 'DIFFERENT'} (within {SFT_LOSS_RTOL:g} relative)")
    lines.append("\ntransformers' own path (FSDP1) not run: every rank first holds the whole model (8 x the "
                 "checkpoint in host memory, over the machine's RAM).")
    if runs:
        run = runs.get("prequant") or runs["trainer"]
        lim, ranks = run["limits"], run["ranks"]
        layers = plan.get("layers") or 0
        if layers and not plan.get("dims"):
            layer = lim["largest_layer"]
            fixed = lim["checkpoint"] - layers * layer  # embedding + head (bf16, kept) + final norm
            grok = fixed + GROK_LAYERS * layer
            world = 8  # GPUs of the node (the ranks measured here: their shares show the split)
            held = [x["load"]["checkpoint_bytes_held"] for x in ranks]
            load_gpu = grok / world + layer
            train = max(x["train"]["peak_rss_anon"] for x in ranks) - max(x["load"]["peak_rss_anon"] for x in ranks)
            lines += [
                "\n## Derived, not measured: a real Grok-1 (64 layers) on an 8-GPU node with load_for_fsdp",
                f"- per decoder layer {layer / 1e9:.3f} GB in NF4 (measured here), embedding + head + norm "
                f"{fixed / 1e9:.3f} GB: 64 layers = {grok / 1e9:.1f} GB",
                f"- per GPU while loading: checkpoint / {world} + the largest layer = {grok / world / 1e9:.1f} + "
                f"{layer / 1e9:.2f} = {load_gpu / 1e9:.1f} GB ({load_gpu / G:.1f} GiB), from the shares measured "
                f"here (each rank's shards held {min(held) / sum(held):.4f}-{max(held) / sum(held):.4f} of the weights)",
                f"- training adds the unsharded layer FSDP2 gathers ({layer / 1e9:.2f} GB, two with prefetch) plus "
                f"bitsandbytes' dequantized bf16 copy of the largest linear weight and activations; on these CPU ranks "
                f"training took RssAnon {train / G:.2f} GiB above the load peak at 16 tokens (batch 1). So at least "
                f"{(grok / world + 2 * layer) / 1e9:.1f} GB per GPU (shards + two gathered layers) plus activations "
                f"and the dequantized weight, which grow with batch and sequence and are not measured here.",
            ]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
