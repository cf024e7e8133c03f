"""devkit/gpu/report.py on hand-made GPU results: every error and constant against the plain computation."""

from __future__ import annotations

import json

import pytest

from devkit.gpu import report as gpu_report
from lowmem_ft.choosing import choose_recipe
from lowmem_ft.memory import estimate as model
from lowmem_ft.memory.arch import catalog_entry
from lowmem_ft.memory.calibration import ALLOCATOR_FRACTION_EXPANDABLE, ALLOCATOR_PAGE_BYTES

GB = 1e9
MODEL = "Qwen/Qwen2.5-0.5B"
CONFIG = catalog_entry(MODEL)[1]["config"]
MiB = 2**20


def point(vram: int, reserved_scale: float, outside: float) -> tuple[dict, model.Estimate]:
    """A CUDA point whose allocated peak is exactly the prediction, reserved the predicted reserved × scale, and
    `outside` bytes outside torch at every phase end."""
    rec = {"kind": "point", "model": MODEL, "config": CONFIG, "vram": vram, "adapter": "qlora"}
    rec |= {"optimizer": "paged_adamw_8bit", "checkpointing": True, "batch": 2, "seq": 2048, "device": "cuda"}
    est = gpu_report.predict_point(rec)
    alloc = est.model_peak_bytes
    reserved = gpu_report.reserved_prediction(est) * reserved_scale
    sample = {"peak_allocated": alloc, "allocated": alloc * 0.9, "peak_reserved": reserved, "reserved": reserved}
    sample["device"] = reserved + outside
    phases = {label: dict(sample) for label in ("static", "backward 2.1", "forward 2.2", "backward 2.2", "optimizer 2")}
    phases["backward 2.1"]["allocated"] = est.phases["static"]
    measured = {
        "exact": alloc,
        "allocated": alloc,
        "reserved": reserved,
        "device": reserved + outside,
        "phases": phases,
    }
    return rec | {"status": "ok", "seconds": 12.0, "measured": measured}, est


@pytest.fixture
def results(tmp_path):
    probe = {
        "kind": "probe",
        "device": "cuda",
        "context": {"allocated": 512, "reserved": 2 * MiB, "device": 2 * MiB + 5e8},
    }
    probe["cublas"] = {
        "bf16 mm": {"kept_allocated": 32 * MiB, "kept_outside": 8 * MiB},
        "fp32 mm": {"kept_allocated": 0, "kept_outside": 0},
        "bf16 linear + bias (Lt)": {"kept_allocated": 1 * MiB, "kept_outside": 0},
    }
    probe["loss_head"] = {
        "shape": {"tokens": 4094, "vocab": 152064, "hidden": 3584},
        "measured": {"forward": 2.70e8, "kept": 1e5, "backward": 3.60e8},
        "predicted": {"forward": 2.68e8, "backward": 3.56e8, "source": "x"},
    }
    good, good_est = point(24, 1.03, 0.6e9)
    loose, loose_est = point(8, 1.10, 0.6e9)
    heavy, heavy_est = point(40, 1.00, 5e9)
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides={"model": {"name_or_path": MODEL}})
    plan = choice.plan_record(recipe)
    train = {"kind": "train", "rc": 0, "error": None, "seconds": 50.0, "plan": plan, "config": CONFIG}
    train |= {"sampled": {"device": 10e9, "reserved": 9.0e9, "allocated": 8e9, "samples": 900}}
    train |= {"memory": {"peak_gb": 8.5, "reserved_gb": 9.1}, "events": [], "metrics": {"global_step": 2}}
    env = {"kind": "env", "python": "3.12.3", "versions": {"torch": "2.11.0"}, "gpu": "NVIDIA H200", "unmet": []}
    step = {"kind": "step", "step": "probe", "status": "ok", "seconds": 14.2, "detail": ""}
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (env, step, probe, good, loose, heavy, train)))
    return path, [(good, good_est), (loose, loose_est), (heavy, heavy_est)]


def test_points_errors_and_targets(results):
    path, points = results
    text = gpu_report.analyze(path)
    assert text.startswith("# Memory model vs CUDA measurement") and "NOT GPU" not in text
    rows = [line for line in text.splitlines() if line.startswith(f"| {MODEL} |") and "qlora" in line][:3]
    (good, _), (loose, _), (heavy, _) = points
    assert rows[0].split("|")[2].strip() == "24" and "(+0.0%)" in rows[0].split("|")[5]  # allocated = prediction
    assert f"({1 / 1.03 - 1:+.1%})" in rows[0].split("|")[6] and "✓" in rows[0]  # reserved 3 % over: in target
    assert f"({1 / 1.10 - 1:+.1%})" in rows[1].split("|")[6] and "✗ reserved > 5 %" in rows[1]
    assert "device under by > 2 GB" in rows[2]  # 5 GB outside torch, the 40 GB tier's margin is 2 GB
    assert "0.60" in rows[0].split("|")[8]  # outside torch


def test_constants_are_the_plain_computation(results):
    path, points = results
    records = gpu_report.load(path)
    figures = [gpu_report.point_row(rec, est)[1] for rec, est in points]
    c = gpu_report.constants(records, figures)
    assert c["context_idle"] == pytest.approx(5e8)
    assert c["cublas_in_allocator"] == 33 * MiB and c["cublas_outside"] == 8 * MiB
    fractions = [
        (rec["measured"]["reserved"] - rec["measured"]["allocated"] - ALLOCATOR_PAGE_BYTES)
        / (est.model_peak_bytes - est.phases["static"])
        for rec, est in points
    ]
    assert c["allocator_max"] == pytest.approx(max(fractions)) and c["allocator_n"] == 3
    assert c["outside_max"] == pytest.approx(5e9) and c["outside_median"] == pytest.approx(0.6e9)
    assert c["live_err_max"] == pytest.approx(0.0)
    code = "\n".join(gpu_report.suggested(c))
    assert f"ALLOCATOR_FRACTION_EXPANDABLE = {max(fractions):.3f}" in code
    assert f"CUBLAS_WORKSPACE_BYTES = {33 * MiB}" in code and "CUDA_CONTEXT_BYTES = 5e+09" in code
    text = gpu_report.analyze(path)
    assert f"| {ALLOCATOR_FRACTION_EXPANDABLE:.3f} | {sorted(fractions)[1]:.3f} / {max(fractions):.3f} |" in text
    assert "forward working set | 0.27 | 0.27 (-0.7%)" in text  # 2.68 vs 2.70 × 1e8


def test_run_row_takes_the_larger_reserved_and_the_sampled_device(results):
    path, _ = results
    text = gpu_report.analyze(path)
    row = next(line for line in text.splitlines() if line.startswith("| train |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[3] == "8.50" and cells[4] == "9.10" and cells[5] == "10.00"
    assert cells[8] == "2" and cells[9].startswith("ok")


def test_a_point_that_ran_out_of_memory_says_where(tmp_path):
    rec = {"kind": "point", "model": MODEL, "config": CONFIG, "vram": 8, "adapter": "qlora", "device": "cuda"}
    rec |= {"optimizer": "paged_adamw_8bit", "checkpointing": True, "batch": 1, "seq": 512, "seconds": 3.0}
    rec |= {"status": "oom", "where": "loading", "measured": {"allocated": 7.9e9, "at_oom": True}}
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    row = next(line for line in gpu_report.analyze(path).splitlines() if line.startswith(f"| {MODEL} |"))
    assert "7.90 /" in row and "out of memory under the cap (loading)" in row and "✗" in row
