"""scripts/bench/ runs end to end on a tiny synthetic checkpoint and reports what the README's tables use.

No timing is asserted (timings belong to the benchmark itself); this keeps the script working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "bench"


@pytest.mark.slow
def test_bench_reports_read_floor_and_prequant_with_ratios_memory_and_timeline(tmp_path):
    report_file = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(BENCH / "convert.py"), "--size-gb", "0.05", "--shape", "uniform",
         "--device", "cpu", "--dir", str(tmp_path / "work"), "--json", str(report_file)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    report = json.loads(report_file.read_text())
    assert report["source_bytes"] > 0.04e9 and report["device"] == "cpu"
    for key in ("read", "read_write", "prequant"):
        m = report[key]
        assert m["seconds"] > 0
        assert m["ratio_to_read"] == round(m["seconds"] / report["read"]["seconds"], 3)
        assert m["ratio_to_floor"] == round(m["seconds"] / report["read_write"]["seconds"], 3)
    p = report["prequant"]
    assert 0 < p["peak_rss_anon"] <= p["peak_vm_rss"]
    assert 0 < p["output_bytes"] < report["source_bytes"]  # NF4: about a third of bf16
    assert p["peak_gpu_process_bytes"] is None and p["peak_gpu_bytes"] is None  # CPU: no GPU figure
    assert p["weight_sha256"] and all(len(h) == 64 for h in p["weight_sha256"].values())
    events = p["trace"]["events"]
    assert list(events)[:1] == ["start"] and events["planned"] <= events["pipeline-end"] <= events["exit"]
    assert not (tmp_path / "work" / "out-prequant").exists()  # outputs removed unless --keep


@pytest.mark.slow
def test_window_bench_runs_every_device_and_window_in_turn_with_one_floor(tmp_path):
    report_file = tmp_path / "window.json"
    subprocess.run(
        [sys.executable, str(BENCH / "window.py"), "--size-gb", "0.05", "--shape", "uniform",
         "--devices", "cpu", "--windows", "0.1,0", "--repeats", "2", "--env", "PREQUANT_PROGRESS=none,lines",
         "--dir", str(tmp_path / "work"),
         "--json", str(report_file)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    report = json.loads(report_file.read_text())
    runs = report["runs"]
    assert [(r["device"], r["window_gb"], r["env"]["PREQUANT_PROGRESS"]) for r in runs] == [
        ("cpu", 0.1, "none"), ("cpu", 0.1, "lines"), ("cpu", 0.0, "none"), ("cpu", 0.0, "lines")] * 2  # in turn
    floor = report["read_write"]["seconds"]
    sys.path.insert(0, str(BENCH))
    from common import disk_of

    sampled = bool(disk_of(tmp_path))  # /proc/diskstats names the work folder's disk (not an overlay, tmpfs)
    for r in runs:
        assert r["same_bytes"] and r["ratio_to_floor"] == round(r["seconds"] / floor, 3)
        assert r["pipeline_start"] <= r["pipeline_end"] and r["read_ahead_done"] is not None
        assert r["quantizer_ready"] <= r["pipeline_end"] and r["peak_rss_anon"] > 0
        # The disk's timeline: a row per whole second sampled (the run and its hashing), each busy a share.
        if not sampled:
            assert r["disk"] == []
        elif r["seconds"] >= 1.2:
            assert r["disk"]
        assert all(0 <= s["busy"] <= 1 and s["read_gbps"] >= 0 and s["write_gbps"] >= 0 for s in r["disk"])
        assert (r["disk_busy"] is not None) == bool(r["disk"])
    assert not (tmp_path / "work" / "out-window").exists()


@pytest.mark.slow
def test_bench_modes_report_consistent_ratios_and_equal_bytes(tmp_path):
    """--also-device, --memory-limit-gib and --hub on the CPU: each path has its ratios, the same weight bytes,
    and the Hub path its wall-time ratio, disk bound and the local server's throughput."""
    report_file = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(BENCH / "convert.py"), "--size-gb", "0.03", "--shape", "uniform",
         "--device", "cpu", "--also-device", "cpu", "--memory-limit-gib", "8", "--hub",
         "--dir", str(tmp_path / "work"), "--json", str(report_file)],
        check=True, capture_output=True, text=True, timeout=900,
    )
    r = json.loads(report_file.read_text())
    for key in ("prequant", "prequant_also", "prequant_limited"):
        m = r[key]
        assert m["ratio_to_floor"] == round(m["seconds"] / r["read_write"]["seconds"], 3)
        assert m["peak_gpu_process_bytes"] is None and m["gpu_process_match"] is None  # no GPU here
        assert m["weight_sha256"] == r["prequant"]["weight_sha256"] and m["weight_sha256"]
    assert r["prequant_also"]["same_bytes"] is True and r["prequant_also"]["device"] == "cpu"
    assert r["prequant_limited"]["same_bytes"] is True and r["prequant_limited"]["memory_limit_bytes"] == 8 * 2**30
    hub = r["hub"]
    c = hub["convert"]
    assert hub["ratio_to_max_download_local"] == round(c["seconds"] / max(hub["download_seconds"], r["prequant"]["seconds"]), 3)
    assert c["same_bytes"] is True and c["disk_bound_bytes"] == 2 * hub["largest_shard_bytes"] + c["output_bytes"]
    assert c["within_disk_bound"] == (c["peak_disk_extra_bytes"] <= c["disk_bound_bytes"])
    assert hub["server_gbps"] > 0 and hub["download_gbps"] > 0
    summary = subprocess.run([sys.executable, str(BENCH / "summary.py"), str(tmp_path / "work")],
                             check=True, capture_output=True, text=True).stdout
    assert "figure (issue 17)" in summary  # prints with every input missing (a step that failed)


@pytest.mark.slow
def test_cpu_kernel_bench_reports_scaling_by_thread_count_beside_bitsandbytes(tmp_path):
    """cpu_kernel.py --threads 1,2: per count each implementation (prequant, bitsandbytes), the ratio,
    efficiency against one thread and the statistics' speed; summary.py reads it."""
    pytest.importorskip("bitsandbytes")
    done = subprocess.run([sys.executable, str(BENCH / "cpu_kernel.py"), "--shapes", "64x4096",
                           "--repeats", "1", "--threads", "1,2", "--json"],
                          check=True, capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout)
    rows = {row["threads"]: row for row in report["results"]}
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert row["speedup_best"] == row["prequant"]["best_gbps"] / row["bitsandbytes"]["best_gbps"]
        assert row["prequant"]["stats_best_gbps"] > 0 and row["prequant"]["threads"] == row["threads"]
    assert rows[1]["prequant"]["efficiency"] == 1.0
    assert rows[2]["prequant"]["efficiency"] == rows[2]["prequant"]["best_gbps"] / (2 * rows[1]["prequant"]["best_gbps"])
    (tmp_path / "cpu_kernel.json").write_text(done.stdout)
    sys.path.insert(0, str(BENCH))
    import summary

    table = {what.split(",")[1].strip(): value for what, value, _, _ in summary.rows(tmp_path) if what.startswith("CPU")}
    assert table["1 thread(s)"] == rows[1]["prequant"]["best_gbps"] and table["16 thread(s)"] is None


def test_nvidia_smi_compute_apps_parse_per_process_bytes():
    """`pid, used_memory` lines (MiB) become bytes per pid; N/A and blank lines are skipped."""
    sys.path.insert(0, str(BENCH))
    from common import parse_compute_apps

    assert parse_compute_apps("1234, 1708\n99, [N/A]\n\n1234, 2\n") == {1234: 1710 * 2**20}


def test_grok_checkpoint_with_model_code_loads_with_every_generated_tensor(tmp_path):
    """scripts/gpu/grok_fsdp_check.sh's checkpoint: Grok shapes (here at reduced dimensions) in keyfan naming with the
    model code of tests/grok/, whose auto_map transformers follows; the model's parameters are the files' tensors."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(BENCH))
    from synthetic import generate

    dims = {"hidden": 64, "inter": 128, "vocab": 256, "heads": 8}
    ckpt = generate("grok", 0, tmp_path / "grok-bench", layers=2, dims=dims, model_code=True)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["auto_map"]["AutoConfig"] == "configuration_grok1.Grok1Config" and config["naming"] == "keyfan"
    assert (config["num_key_value_heads"], config["num_hidden_layers"]) == (8, 2)
    model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.bfloat16)
    files = {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            files.update({k: sf.get_tensor(k) for k in sf.keys()})
    state = model.state_dict()
    assert set(state) == set(files)
    assert all(torch.equal(state[k], v) for k, v in files.items())


MOE_DIMS = {  # scripts/gpu/moe_fp8.sh's reduced dimensions (TINY=1)
    "mixtral": {"hidden": 256, "inter": 512, "heads": 4, "kv_heads": 2, "vocab": 512},
    "qwen3_moe": {"hidden": 256, "inter": 64, "heads": 4, "kv_heads": 2, "head_dim": 64, "experts": 16, "vocab": 512},
    "deepseek_v3": {"hidden": 320, "inter": 96, "dense_inter": 400, "heads": 4, "experts": 8, "groups": 2,
                    "topk_groups": 1, "active": 2, "q_lora": 192, "kv_lora": 128, "rope": 16, "nope": 32, "v_head": 32,
                    "vocab": 512},
}


@pytest.mark.parametrize("shape", list(MOE_DIMS))
def test_moe_checkpoints_have_the_names_and_shapes_transformers_saves(tmp_path, shape):
    """synthetic.py's MoE shapes: every tensor transformers 5 saves for the model of their config.json, per expert,
    under the same names and shapes (DeepSeek-V3: FP8 codes all finite, a float32 scale per 128x128 block)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(BENCH))
    from synthetic import generate

    ckpt = generate(shape, 0, tmp_path / shape, layers=2, dims=MOE_DIMS[shape])
    files = {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            files.update({k: sf.get_tensor(k) for k in sf.keys()})
    config = json.loads((ckpt / "config.json").read_text())
    qc = config.pop("quantization_config", None)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "cfg")).save_pretrained(tmp_path / "ref")
    saved = {}
    for f in (tmp_path / "ref").glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            saved.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})
    weights = {k: tuple(v.shape) for k, v in files.items() if not k.endswith("weight_scale_inv")}
    assert weights == saved
    assert any(".experts.1." in k for k in saved)
    scales = {k.removesuffix("_scale_inv"): v for k, v in files.items() if k.endswith("weight_scale_inv")}
    if shape != "deepseek_v3":
        assert qc is None and not scales and {v.dtype for v in files.values()} == {torch.bfloat16}
        return
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    fp8 = {k for k, v in files.items() if v.dtype == torch.float8_e4m3fn}
    assert fp8 == set(scales) and "model.layers.1.mlp.experts.7.down_proj.weight" in fp8
    assert "model.layers.1.mlp.gate.weight" not in fp8 and "model.layers.0.mlp.gate_proj.weight" in fp8
    for k in fp8:
        assert torch.isfinite(files[k].float()).all(), k
        assert tuple(scales[k].shape) == tuple(-(-d // 128) for d in files[k].shape) and (scales[k] > 0).all()


@pytest.mark.slow
def test_moe_memory_bench_loads_and_trains_both_ways_and_reports(tmp_path):
    """moe_memory.py (scripts/gpu/moe_fp8.sh's memory step) on the CPU: load_for_fsdp of the 4-bit-experts output with
    LoRA on attention and experts, transformers' quantize-on-load of the source with LoRA on attention, one step
    each."""
    sys.path.insert(0, str(ROOT / "tests"))
    from moe_checkpoints import build_moe

    import prequant

    src = build_moe("mixtral", tmp_path / "src")
    prequant.convert(src, tmp_path / "ckpt", device="cpu", progress=False, quantize_experts=True)
    subprocess.run([sys.executable, str(BENCH / "moe_memory.py"), "--checkpoint", str(tmp_path / "ckpt"), "--source",
                    str(src), "--seq-len", "16", "--json", str(tmp_path / "m.json")],
                   check=True, capture_output=True, text=True, timeout=600)  # fmt: skip
    report = json.loads((tmp_path / "m.json").read_text())
    ours, theirs = report["prequant"], report["transformers"]
    assert "error" not in ours and "error" not in theirs
    # 2 layers: 4 attention linears and 4 experts x 3 projections 4-bit, LoRA on each; transformers: attention only
    assert (ours["linear4bit_modules"], ours["lora_modules"]) == (2 * (4 + 12), 2 * (4 + 12))
    assert (theirs["linear4bit_modules"], theirs["lora_modules"]) == (2 * 4, 2 * 4)
    for r in (ours, theirs):
        assert r["step"]["loss"] > 0 and r["load"]["peak_gpu_allocated"] is None  # CPU: no GPU figure


def test_synthetic_checkpoint_from_the_command_line_as_the_gpu_drivers_generate_it(tmp_path):
    """scripts/bench/synthetic.py OUT ...: what scripts/gpu/*.sh run for their source (here reduced dimensions)."""
    dims = {"hidden": 64, "inter": 128, "vocab": 256, "heads": 8}
    done = subprocess.run([sys.executable, str(BENCH / "synthetic.py"), str(tmp_path / "grok"), "--shape", "grok",
                           "--layers", "1", "--model-code", "--dims", json.dumps(dims)],
                          check=True, capture_output=True, text=True, timeout=300)  # fmt: skip
    config = json.loads((tmp_path / "grok" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["naming"]) == (64, 1, "keyfan")
    assert (tmp_path / "grok" / "modeling_grok1.py").is_file() and "generated" in done.stderr
    missing = subprocess.run([sys.executable, str(BENCH / "synthetic.py"), str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert missing.returncode == 2 and "--size-gb or --layers" in missing.stderr and not (tmp_path / "none").exists()


@pytest.mark.slow
def test_startup_bench_times_whole_processes_beside_a_baseline(tmp_path):
    """startup.py: best wall and CPU seconds per mode (the children's CPU, the layout child's too), the events of
    prequant's trace as seconds since its first, and the two keys summary.py reads."""
    report_file = tmp_path / "startup.json"
    subprocess.run([sys.executable, str(BENCH / "startup.py"), "--repeats", "1", "--device", "cpu",
                    "--skip", "head start", "--json", str(report_file)],
                   check=True, capture_output=True, text=True, timeout=600)  # fmt: skip
    report = json.loads(report_file.read_text())
    modes = report["modes"]
    assert set(modes) == {"baseline", "predicted", "dry-run baseline", "dry-run"}
    assert report["convert_seconds"] == modes["predicted"]["best_wall_s"] > 0
    assert report["dry_run_seconds"] == modes["dry-run"]["best_wall_s"] > 0
    for m in modes.values():
        assert m["best_cpu_s"] > 0 and m["walls"] == [m["best_wall_s"]]
        events = m["events"]
        assert list(events)[:1] == ["start"] and events["start"] == 0.0 and events["exit"] <= m["best_wall_s"]
    assert "pipeline-end" in modes["predicted"]["events"]


def test_fsdp_summary_of_each_gpu_driver_prints_and_writes_what_it_found(tmp_path):
    """scripts/gpu/fsdp_summary.py KIND OUT, the last step of each check-fsdp driver: with no report (every step
    failed or ran out of time) it still writes summary.md, saying what is missing."""
    for kind in ("fsdp", "trainer", "grok"):
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "fsdp_summary.py"), kind, str(tmp_path)],
                              check=True, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "no report" in done.stdout and (tmp_path / "summary.md").read_text() == done.stdout


@pytest.mark.slow
def test_cpu_kernel_profile_reports_each_measurement_by_thread_count():
    """profile_cpu_kernel.py: single operations, the kernel (its own piece rule and a fixed piece), the statistics,
    double quantization and worker processes, each row with its speed-up against the first thread count."""
    done = subprocess.run([sys.executable, str(BENCH / "profile_cpu_kernel.py"), "--shape", "64x4096",
                           "--threads", "1,2", "--seconds", "0.02", "--pieces", "0,8192", "--stats-tasks", "65536",
                           "--repeats", "1"], check=True, capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout)
    assert report["topology"]["logical_cpus"] >= 1
    assert {(r["op"], r["threads"]) for r in report["ops"]} >= {("index_select", 1), ("multiply", 2)}
    assert [(r["piece"], r["threads"]) for r in report["kernel"]] == [(0, 1), (0, 2), (8192, 1), (8192, 2)]
    for section in ("ops", "kernel", "stats", "processes"):
        first = [r for r in report[section] if r["speedup"] == 1.0]
        assert first and all(r.get("gbps", r.get("gelem_per_s", 0)) > 0 for r in report[section])
    assert [r["threads"] for r in report["nested"]] == [1, 2] and all(r["ms"] > 0 for r in report["nested"])
    assert [r["processes"] for r in report["processes"]] == [1, 2]


def test_disk_timeline_reads_diskstats_per_second():
    sys.path.insert(0, str(BENCH))
    from common import diskstats, timeline

    line = " 253       0 vda 10 0 {r} 0 0 0 {w} 0 0 {busy} 0 0 0 0 0 0 0"
    first = diskstats(line.format(r=2_000_000, w=0, busy=100))
    assert first == {"vda": (2_000_000 * 512, 0, 100)}
    later = diskstats(line.format(r=2_000_000 + 2 * 10**9 // 512, w=10**9 // 512, busy=600))["vda"]
    rows = [(0.0, *first["vda"]), (0.5, *first["vda"]), (2.0, *later)]
    assert timeline(rows) == [{"t": 0.0, "read_gbps": 1.0, "write_gbps": 0.5, "busy": 0.25}]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_hub_scale_bench_measures_the_floor_faults_and_a_killed_run_to_the_same_bytes(tmp_path, fmt):
    """scripts/bench/hub_scale.py end to end on a small Grok-1-shaped repo of 9 shards served by the tests' Hub."""
    report_file = tmp_path / "hub.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "hub_scale.py"), "--shape", "grok", "--layers", "3",
         "--dims", '{"hidden": 512, "inter": 2048, "vocab": 4096, "heads": 8}', "--shard-gb", "0.02",
         "--format", fmt, "--model-code", "--device", "cpu", "--faults", "--kill", "--local",
         "--variant", "PREQUANT_PROGRESS=none PREQUANT_HUB_RETRY_S=5",
         "--variant", "PREQUANT_PROGRESS=none PREQUANT_HUB_RETRY_S=5", "--endpoint-warm",
         "--repeats", "2",
         "--dir", str(tmp_path / "work"), "--json", str(report_file)],
        check=True, capture_output=True, text=True, timeout=900,
    )
    r = json.loads(report_file.read_text())
    assert r["shards"] == 9 and r["format"] == fmt
    c = r["convert"]
    assert r["local"]["same_bytes"] and c["same_bytes_as_local"]  # the served folder, converted from disk
    assert c["within_scratch_bound"] and 0 < c["scratch_shards_peak_bytes"] <= r["scratch_bound_bytes"], (
        r["largest_shard_bytes"], c["scratch_shards_at_peak"])
    assert c["ratio_to_floor"] == round(c["seconds"] / r["floor"]["seconds"], 3) and r["floor"]["client"]
    # cut a third of the way, its resume refused three times, then the rest from the same byte: the burst ridden out
    bodies = r["fault"]["bodies"]
    assert r["fault"]["same_bytes"] and [status for status, _ in bodies] == [200, 503, 503, 503, 206], bodies
    assert bodies[0][1] is None and len({asked for _, asked in bodies[1:]}) == 1
    variant = r["variants"]["PREQUANT_PROGRESS=none PREQUANT_HUB_RETRY_S=5"]
    assert variant["env"] == {"PREQUANT_PROGRESS": "none", "PREQUANT_HUB_RETRY_S": "5"}  # both set
    assert variant["same_bytes"] and variant["within_scratch_bound"]
    again = r["variants"]["PREQUANT_PROGRESS=none PREQUANT_HUB_RETRY_S=5 #2"]  # given twice: run twice
    assert again["same_bytes"] and again["env"] == variant["env"] and len(r["variants"]) == 2
    assert r["download"]["seconds"] > 0 and r["transfer"]["seconds"] > 0  # each client alone
    # the served files read back after each drop: 2 conversions, floor, fault, kill, the variant twice, each client alone
    assert r["endpoint"] == "warm" and len(r["endpoint_warm_seconds"]) == 9, r["endpoint_warm_seconds"]
    # the first conversion again: the same bytes, and the median of the two times (their mean)
    assert c["repeats_same_bytes"] == [True] and len(c["repeat_seconds"]) == 2
    assert c["median_seconds"] == sum(c["repeat_seconds"]) / 2
    assert c["median_ratio_to_floor"] == round(c["median_seconds"] / r["floor"]["seconds"], 3)
    killed, resumed = r["kill"]["killed"], r["kill"]["resumed"]
    assert killed["returncode"] == -9 and killed["partials_left"]  # killed mid-body: its partial file is left
    assert resumed["same_bytes"] and resumed["partials_left"] == [] and resumed["within_scratch_bound"]


def _bench_module(name: str):
    sys.path.insert(0, str(BENCH))
    return __import__(name)


def test_elf_reads_torch_s_sections_and_needed_libraries():
    """The probe's ELF reader (scripts/bench/elf.py) on a library every test machine has: torch's own."""
    import torch

    elf = _bench_module("elf")
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    secs = elf.sections(lib)
    by_name = {s.name: s for s in secs}
    assert by_name[".text"].alloc and by_name[".dynsym"].alloc
    assert all(s.offset + s.size <= lib.stat().st_size for s in secs)
    if ".symtab" in by_name:  # not stripped: the symbol table is never mapped
        assert not by_name[".symtab"].alloc
    names, run_path = elf.needed(lib)
    assert "libc10.so" in names and any(Path(p).resolve() == lib.parent.resolve() for p in run_path)


def test_elf_refuses_what_is_not_a_64_bit_little_endian_elf(tmp_path):
    import struct

    elf = _bench_module("elf")
    text = tmp_path / "notes.txt"
    text.write_text("not a library")
    short = tmp_path / "short.so"
    short.write_bytes(b"\x7fELF\x02\x01" + b"\0" * 10)
    big_endian = tmp_path / "be.so"
    big_endian.write_bytes(b"\x7fELF\x02\x02" + b"\0" * 100)
    bad_table = tmp_path / "bad.so"
    head = bytearray(b"\x7fELF\x02\x01" + b"\0" * 58)
    struct.pack_into("<Q", head, 0x28, 10**9)  # section headers far past the end
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 1)
    bad_table.write_bytes(bytes(head))
    for f in (text, short, big_endian, bad_table, tmp_path / "missing.so"):
        assert elf.sections(f) is None and elf.needed(f) is None


def test_cold_start_reads_back_exactly_the_resident_runs_and_groups_them(tmp_path):
    cold_start = _bench_module("cold_start")
    page = cold_start.PAGE
    f = tmp_path / "site-packages" / "nvidia" / "cu13" / "lib" / "libx.so"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"\1" * (6 * page))
    pages = bytes([1, 1, 0, 0, 1, 0])
    assert cold_start.ranges({str(f): pages}) == [(str(f), 0, 2 * page), (str(f), 4 * page, page)]
    seconds, n = cold_start.read_ahead(cold_start.ranges({str(f): pages}))
    assert n == 3 * page and seconds >= 0
    d = cold_start.describe({str(f): pages})
    assert d["groups"]["nvidia/cu13"] == {"files": 1, "resident": 3 * page, "size": 6 * page}
    assert cold_start.group("/x/site-packages/torch/lib/libtorch_cuda.so") == "torch/lib"
    assert cold_start.group("/tmp/pycache/x/torch/nn/functional.cpython-312.pyc") == "python"


@pytest.mark.slow
def test_merge_bench_merges_into_both_bases_against_the_floor(tmp_path):
    report_file = tmp_path / "merge.json"
    subprocess.run(
        [sys.executable, str(BENCH / "merge.py"), "--size-gb", "0.05", "--shape", "uniform", "--device", "cpu",
         "--rank", "4", "--dir", str(tmp_path / "work"), "--json", str(report_file)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    report = json.loads(report_file.read_text())
    assert report["rank"] == 4 and report["adapter_bytes"] > 0
    for name in ("merge16", "merge4"):
        m = report[name]
        assert m["ratio_to_floor"] == round(m["seconds"] / m["floor_seconds"], 3)
        assert 0 < m["peak_rss_anon"] <= m["peak_vm_rss"]
        assert m["output_bytes"] > 0.9 * report["merge16"]["input_bytes"]  # 16-bit out from either base
    assert report["merge4"]["input_bytes"] < report["merge16"]["input_bytes"] / 2  # the 4-bit base reads less
    assert not (tmp_path / "work" / "out-merge16").exists()


@pytest.mark.slow
def test_publish_bench_times_push_against_convert_then_upload(tmp_path):
    """scripts/bench/publish.py end to end on a small checkpoint: both modes publish the output in one commit."""
    report_file = tmp_path / "publish.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "publish.py"), "--size-gb", "0.1", "--max-shard-size", "10MB", "--device", "cpu",
         "--dir", str(tmp_path / "work"), "--json", str(report_file)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(report_file.read_text())
    assert report["push"]["seconds"] > 0 and report["sequential"]["seconds"] > 0
    assert report["ratio"] == round(report["push"]["seconds"] / report["sequential"]["seconds"], 3)
    assert report["push"]["weight_bytes"] == report["sequential"]["weight_bytes"] > 0
    assert report["push"]["objects_sent"] == report["sequential"]["objects_sent"] > 1  # each shard once
    assert "ratio" in proc.stderr
