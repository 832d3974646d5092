"""summary.md of the GPU machine's check_fsdp.py drivers, from the reports each leaves in OUT (printed too):

    python3 scripts/gpu/fsdp_summary.py fsdp OUT      # fsdp_gpu_check.sh: check-fsdp.json, check-fsdp-bf16-storage.json
    python3 scripts/gpu/fsdp_summary.py trainer OUT   # trainer_gpu_check.sh: check-fsdp-gpu.json, check-fsdp-cpu8.json
    python3 scripts/gpu/fsdp_summary.py grok OUT      # grok_fsdp_check.sh: plan.json, check-prequant.json,
                                                      # check-trainer.json

fsdp: a row per loader (2 GPUs), figures per rank joined by " / ". trainer: a row per loader and rank. grok: per rank
of each report (load seconds, RssAnon, RssFile, the checkpoint bytes its shards hold, losses, packed bytes intact),
and, derived from those figures (not measured), what a real Grok-1 (64 layers) needs per GPU on an 8-GPU node with
load_for_fsdp. A missing report is said so; a loader that failed shows its error.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

G = 2**30
SFT_LOSS_RTOL = 1e-6  # scripts/bench/check_fsdp.py's SFT_LOSS_RTOL: TRL's loss kernel against the model's own loss
GROK_LAYERS = 64


def _completed(r: dict, lines: list[str]):
    """(loader, run, summary) of each loader of report `r` that completed; a row naming the error for the others."""
    for loader, run in r["runs"].items():
        if run.get("summary"):
            yield loader, run, run["summary"]
        else:
            lines.append(f"| {loader} | failed: {run.get('error')} |")


def _limits(r: dict) -> str | None:
    lim = next(iter(r["runs"].values())).get("limits")
    return lim and (f"checkpoint {lim['checkpoint'] / 1e9:.2f} GB, largest layer {lim['largest_layer'] / G:.2f} GiB; "
                    f"load_for_fsdp's GPU load limit {lim['gpu_load'] / G:.2f} GiB, "
                    f"RssAnon {lim.get('rss_anon', 2 * G) / G:g} GiB")


def fsdp(out: Path) -> list[str]:
    lines: list[str] = []
    p = out / "check-fsdp.json"
    if p.is_file():
        r = json.loads(p.read_text())
        lines += ["| loader | load s | peak GPU load (GiB/rank) | peak GPU train (GiB/rank) | peak RssAnon (GiB/rank) "
                  "| peak RssFile (GiB/rank) | packed bytes intact | first-step loss | last loss |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        problems = []
        for loader, run, s in _completed(r, lines):
            def per(key: str, *phases: str) -> str:
                return " / ".join(f"{max(x[phase][key] for phase in phases) / G:.2f}" for x in run["ranks"])

            lines.append(f"| {loader} | {s['load_seconds']:.0f} | {per('peak_gpu_allocated', 'load')} | "
                         f"{per('peak_gpu_allocated', 'train')} | {per('peak_rss_anon', 'load', 'train')} | "
                         f"{per('peak_rss_file', 'load', 'train')} | {'yes' if s['packed_intact'] else 'NO'} "
                         f"({s['packed_tensors']} tensors, {s['nan_patterns']} NaN patterns) | {s['losses'][0]:.6f} | "
                         f"{s['losses'][-1]:.6f} |")  # fmt: skip
            problems.append(f"{loader}: problems {s['problems'] or 'none'}; losses {s['losses']}")
        if limits := _limits(r):
            lines.append(f"\n{limits}")
        lines += [f"first-step loss comparison: {json.dumps(r['comparison'])}; overall ok: {r['ok']}", *problems]
    p = out / "check-fsdp-bf16-storage.json"
    if p.is_file():
        s = json.loads(p.read_text())["runs"]["prequant"].get("summary", {})
        lines.append(f"\nbf16 packed storage under FSDP2: mismatched bytes at rest {s.get('mismatched_at_rest')}, in "
                     f"forward {s.get('mismatched_in_forward')}, words turned into a canonical NaN "
                     f"{s.get('nan_canonicalized')} (of {s.get('nan_patterns')} NaN patterns); first loss "
                     f"{s.get('losses', [None])[0]}")
    return lines or ["no report"]


def trainer(out: Path) -> list[str]:
    lines: list[str] = []
    for name, title in (("check-fsdp-gpu.json", "one GPU (--nproc 1)"), ("check-fsdp-cpu8.json", "CPU, gloo ranks")):
        p = out / name
        if not p.is_file():
            lines.append(f"{title}: no report")
            continue
        r = json.loads(p.read_text())
        lines += [f"\n{title}: {r['checkpoint']} on {r['nproc']} ranks; ok: {r['ok']}; comparison: "
                  f"{json.dumps(r['comparison'])}",
                  "| loader | rank | load s | peak GPU load GiB | peak GPU train GiB | peak RssAnon load / train GiB | "
                  "peak RssFile load GiB | RssFile at start GiB | checkpoint bytes in its shards GB | first loss | "
                  "last loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for loader, run, s in _completed(r, lines):
            for x in run["ranks"]:
                ld, tr = x["load"], x["train"]
                shard = ld.get("checkpoint_bytes_held")
                lines.append(f"| {loader} | {x['rank']} | {ld['seconds']:.1f} | {ld['peak_gpu_allocated'] / G:.2f} | "
                             f"{tr['peak_gpu_allocated'] / G:.2f} | {ld['peak_rss_anon'] / G:.2f} / "
                             f"{tr['peak_rss_anon'] / G:.2f} | {ld['peak_rss_file'] / G:.2f} | "
                             f"{ld.get('at_start_rss_file', 0) / G:.2f} | "
                             f"{'-' if shard is None else f'{shard / 1e9:.3f}'} | {x['losses'][0]:.6f} | "
                             f"{x['losses'][-1]:.6f} |")  # fmt: skip
            lines.append(f"{loader}: problems {s['problems'] or 'none'}; packed intact {s['packed_intact']} "
                         f"({s['packed_tensors']} tensors); losses {s['losses']}")
        if limits := _limits(r):
            lines.append(limits)
    return lines


def _grok_table(name: str, r: dict) -> tuple[list[str], dict | None]:
    lines = [f"\n## {name}: {r['checkpoint']} on {r['nproc']} gloo ranks (CPU); check-fsdp ok: {r['ok']}"]
    runs = list(_completed(r, lines))
    if not runs:
        return lines, None
    _, run, s = runs[0]
    lim = run["limits"]
    weights = sum(x["load"].get("checkpoint_bytes_held") or 0 for x in run["ranks"])  # the shards tile the weights once
    lines += ["| rank | load s | peak RssAnon load GiB | RssAnon load - shards GiB | peak RssAnon train GiB | "
              "peak RssFile load GiB | RssFile at start GiB | checkpoint bytes in its shards GB (share of the weights) | "
              "losses | packed bytes intact |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in run["ranks"]:
        ld, tr, p = x["load"], x["train"], x["packed"]
        held = ld.get("checkpoint_bytes_held") or 0
        intact = p["mismatched_at_rest"] == 0 and p["mismatched_in_forward"] == 0  # (layers that ran: checked_in_forward)
        lines.append(f"| {x['rank']} | {ld['seconds']:.1f} | {ld['peak_rss_anon'] / G:.2f} | "
                     f"{(ld['peak_rss_anon'] - held) / G:.2f} | {tr['peak_rss_anon'] / G:.2f} | {ld['peak_rss_file'] / G:.2f} | "
                     f"{ld.get('at_start_rss_file', 0) / G:.2f} | {held / 1e9:.3f} ({held / max(weights, 1):.4f}) | "
                     f"{' '.join(f'{v:.6f}' for v in x['losses'])} | {'yes' if intact else 'NO'} ({p['bytes'] / 1e9:.2f} GB; "
                     f"{p['checked_in_forward']} of {p['tensors']} in the forward) |")
    lines.append(f"\nsteps {len(s['losses'])}, train {max(x['train']['seconds'] for x in run['ranks']):.0f} s; problems: "
                 f"{s['problems'] or 'none'}; {s['packed_tensors']} packed tensors, {s['nan_patterns']} bf16-NaN patterns; "
                 f"checkpoint {lim['checkpoint'] / 1e9:.2f} GB ({weights / 1e9:.2f} GB of weights in the ranks' shards; the "
                 f"quant states, complete on every rank, aside), largest layer {lim['largest_layer'] / G:.2f} GiB. On the "
                 "CPU a rank's shards are its own anonymous memory: 'RssAnon load - shards' is what the 2 GiB limit "
                 "(for GPU ranks, whose shards are on the GPU) bounds.")
    return lines, run


def grok(out: Path) -> list[str]:
    lines = ["# Grok-1-shaped checkpoint, 8 FSDP ranks (scripts/gpu/grok_fsdp_check.sh)"]
    plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").is_file() else {}
    lines.append(f"plan: {json.dumps(plan)}")
    runs = {}
    for loader in ("prequant", "trainer"):
        p = out / f"check-{loader}.json"
        if not p.is_file():
            lines.append(f"\n## {loader}: no report")
            continue
        table, run = _grok_table(loader, json.loads(p.read_text()))
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
    return lines


KINDS = {"fsdp": fsdp, "trainer": trainer, "grok": grok}


def main(kind: str, out: Path) -> None:
    text = "\n".join(KINDS[kind](out))
    (out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in KINDS:
        sys.exit(__doc__)
    main(sys.argv[1], Path(sys.argv[2]))
