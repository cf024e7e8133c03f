"""The GPU check's results (`results.jsonl` from `devkit.gpu.check`) as a markdown table and the CUDA constants they imply.

    python -m devkit.gpu.check --analyze RESULTS [--md benchmarks/estimator_gpu.md]

The one idea: measured figures are kept as measured, predictions are recomputed from the memory model as it is
now (the harness's `predict`; a run's `Setup` from its plan.json), so after the CUDA constants in
`lowmem_ft/memory/estimate.py` are recalibrated from this table, running the analysis again on the same results
shows the new errors without a device. Pure arithmetic over the records: no torch.

What is compared (decimal GB):
- allocated (torch.cuda.max_memory_allocated) with the model's live bytes (`Estimate.model_peak_bytes`);
- reserved (max_memory_reserved) with live bytes + the allocator term — the issue's target: within 5 %;
- device = reserved peak + memory outside torch (NVML − reserved at the phase ends; the runs' 20 Hz sampler sees
  NVML directly) with the full prediction (context and cuBLAS workspaces too) — never under it by more than the
  tier's safety margin.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from devkit.gpu.published import section as published_section
from lowmem_ft.memory import estimate as model
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import ALLOCATOR_FRACTION_EXPANDABLE, ALLOCATOR_PAGE_BYTES
from lowmem_ft.memory.estimate import Estimate, Setup
from lowmem_ft.memory.overheads import allocator_component_bytes

GB = 1e9
RESERVED_TARGET = 0.05  # issue #15: predicted within 5 % of reserved
# The harness's phases of the steady-state step (step 2: states and accumulated gradients exist), as in
# devkit/bench/estimator.py phase_measurements: (phase, measured label, CUDA sample key, CPU (peak, live) index)
PHASES = (
    ("static", "backward 2.1", "allocated", 1),
    ("forward", "forward 2.2", "peak_allocated", 0),
    ("backward", "backward 2.2", "peak_allocated", 0),
    ("optimizer step", "optimizer 2", "peak_allocated", 0),
)


def load(path: Path) -> list[dict[str, Any]]:
    path = path / "results.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def gb(x: float | None) -> str:
    """Decimal GB, with more digits below 0.1 GB (the CPU smoke run's toy models)."""
    if x is None:
        return "—"
    return f"{x / GB:.2f}" if abs(x) >= 0.1 * GB else f"{x / GB:.4f}"


def err(pred: float, meas: float | None) -> str:
    return "" if not meas else f" ({(pred - meas) / meas:+.1%})"


def tier_margin_gb(vram: float) -> float:
    from lowmem_ft.choosing import tier_for_vram
    from lowmem_ft.recipe.load import resolve

    return resolve(tier_for_vram(vram, strict=False)).memory.safety_margin_gb


# -- predictions as the model stands now ------------------------------------------------------------------------------
def predict_point(rec: dict[str, Any]) -> Estimate:
    """The harness's `predict` for a point record (its config written where `predict` reads it)."""
    from devkit.harness.estimator import Point, predict

    fields = ("adapter", "optimizer", "checkpointing", "batch", "seq")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "lowmem_config.json").write_text(json.dumps(rec["config"]))
        return predict(Path(tmp), Point(rec["model"], **{k: rec[k] for k in fields}), device=rec["device"])


def predict_run(rec: dict[str, Any]) -> Estimate | None:
    """The estimate of a train/context run's planned setup (plan.json) with the model as it is now."""
    plan = rec.get("plan")
    if not plan or "config" not in rec:
        return None
    setup = {**plan["setup"], "lora_targets": tuple(plan["setup"]["lora_targets"])}
    return model.estimate(Architecture.from_config(rec["config"]), Setup(**setup))


def reserved_prediction(est: Estimate) -> float:
    return est.model_peak_bytes + allocator_component_bytes(est.components)


def transient(est: Estimate) -> float:
    return est.model_peak_bytes - est.phases["static"]


# -- what a point measured -----------------------------------------------------------------------------------------
def outside_torch(measured: dict[str, Any]) -> float | None:
    """The most device memory outside torch's allocator at any phase end (NVML − reserved)."""
    values = [s["device"] - s["reserved"] for s in measured.get("phases", {}).values() if "reserved" in s]
    return max(values) if values else None


def device_peak(measured: dict[str, Any]) -> float | None:
    """Device peak: the larger of NVML at the phase ends and reserved peak + what lies outside torch."""
    out = outside_torch(measured)
    if out is None:
        return measured.get("device")
    return max(measured.get("device", 0.0), measured["reserved"] + out)


def measured_phases(rec: dict[str, Any]) -> dict[str, float]:
    ph = rec["measured"].get("phases", {})
    out = {}
    for phase, label, key, index in PHASES:
        if label in ph:
            out[phase] = ph[label][key] if rec["device"] == "cuda" else ph[label][index]
    return out


# -- tables -----------------------------------------------------------------------------------------------------------
POINT_HEADER = (
    "| model | --vram | adapter | batch × seq | allocated GB meas / pred (err) | reserved GB meas / pred (err) "
    "| device GB meas / pred (err) | outside torch GB | exact live GB | target | time |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
)


def point_row(rec: dict[str, Any], est: Estimate) -> tuple[str, dict[str, Any]]:
    """One table row and the figures the constants use."""
    m = rec["measured"]
    head = f"| {rec['model']} | {rec['vram']} | {rec['adapter']} | {rec['batch']} × {rec['seq']} |"
    if rec.get("status", "ok") != "ok":
        what = f"out of memory under the cap ({rec.get('where', '?')})" if rec["status"] == "oom" else rec.get("error")
        return (
            f"{head} {gb(m.get('allocated'))} / {gb(est.model_peak_bytes)} | {what} | | | | ✗ | {rec['seconds']} s |",
            {},
        )
    if rec["device"] != "cuda":  # CPU: the exact live bytes are the only figure
        exact = m["exact"]
        cells = f" — | — | — | — | {gb(exact)} / {gb(est.model_peak_bytes)}{err(est.model_peak_bytes, exact)} | CPU |"
        return f"{head}{cells} {rec['seconds']} s |", {"live_err": (est.model_peak_bytes - exact) / exact}
    alloc, reserved, device, outside = m["allocated"], m["reserved"], device_peak(m), outside_torch(m)
    pred_res = reserved_prediction(est)
    margin = tier_margin_gb(rec["vram"]) * GB
    res_ok = abs(pred_res - reserved) / reserved <= RESERVED_TARGET
    dev_ok = device is None or device - est.peak_bytes <= margin
    target = (
        "✓"
        if res_ok and dev_ok
        else "✗ "
        + " ".join(
            x
            for x, bad in (("reserved > 5 %", not res_ok), (f"device under by > {margin / GB:g} GB", not dev_ok))
            if bad
        )
    )
    row = (
        f"{head} {gb(alloc)} / {gb(est.model_peak_bytes)}{err(est.model_peak_bytes, alloc)} | {gb(reserved)} / "
        f"{gb(pred_res)}{err(pred_res, reserved)} | {gb(device)} / {gb(est.peak_bytes)}{err(est.peak_bytes, device)} "
        f"| {gb(outside)} | {gb(m.get('exact'))} | {target} | {rec['seconds']} s |"
    )
    figures = {
        "live_err": (est.model_peak_bytes - alloc) / alloc,
        "reserved_err": (pred_res - reserved) / reserved,
        # the GPU kit runs `train`, which sets expandable segments: the term of that setting, pages taken out
        "allocator_fraction": (reserved - alloc - ALLOCATOR_PAGE_BYTES) / transient(est)
        if transient(est) > 0
        else None,
        "reserved_over_allocated": reserved / alloc - 1,
        "outside": outside,
    }
    return row, figures


def phase_row(rec: dict[str, Any], est: Estimate) -> str | None:
    meas = measured_phases(rec)
    if not meas:
        return None
    cells = " | ".join(f"{gb(meas.get(p))} / {gb(est.phases[p])}{err(est.phases[p], meas.get(p))}" for p, *_ in PHASES)
    return f"| {rec['model']} | {rec['vram']} | {rec['adapter']} | {cells} |"


RUN_HEADER = (
    "| run | plan | predicted GB: live / full (now) | allocated peak GB | reserved peak GB | device peak GB "
    "(NVML − idle) | budget GB | OOM events | steps | result |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
)


def run_row(rec: dict[str, Any]) -> str:
    plan, sampled, memory = rec.get("plan") or {}, rec.get("sampled", {}), rec.get("memory", {})
    setup = plan.get("setup", {})
    knobs = [setup.get("quantization", "?"), f"batch {setup.get('micro_batch_size')} × {setup.get('max_seq_len')}"]
    knobs += [n for k, n in (("gradient_checkpointing", "ckpt"), ("activation_offloading", "offload")) if setup.get(k)]
    knobs += ["chunked loss"] if setup.get("loss_impl") == "chunked" else []
    now = predict_run(rec)
    predicted = "—"
    if plan:
        predicted = f"{gb(plan['model_peak_gb'] * GB)} / {gb(plan['predicted_peak_gb'] * GB)}"
    if now is not None:
        predicted += f" ({gb(now.model_peak_bytes)} / {gb(now.peak_bytes)})"
    allocated = memory.get("peak_gb")
    reserved = max(sampled.get("reserved", 0.0) / GB, memory.get("reserved_gb", 0.0)) or None
    device = sampled.get("device", 0.0) / GB or None
    ooms = sum(1 for e in rec.get("events", []) if str(e.get("event", "")).startswith("oom"))
    steps = (rec.get("metrics") or {}).get("global_step", "—")
    result = "ok" if rec["rc"] == 0 else f"exit {rec['rc']}: {rec.get('error') or 'see the log'}"

    def fmt(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    device_cell = fmt(device)
    if device is None and "rss_gb" in memory:  # no CUDA: the host's resident set is all there is
        device_cell = f"— (host RSS {memory['rss_gb']:.2f})"
    return (
        f"| {rec['kind']} | {', '.join(map(str, knobs))} | {predicted} | {fmt(allocated)} | {fmt(reserved)} | "
        f"{device_cell} | {plan.get('budget_gb', '—')} | {ooms} | {steps} | {result} ({rec['seconds']} s) |"
    )


# -- constants ------------------------------------------------------------------------------------------------------
def constants(records: list[dict[str, Any]], figures: list[dict[str, Any]]) -> dict[str, float]:
    """The CUDA terms as measured (bytes, or fractions), from the probe and the points' figures."""
    out: dict[str, float] = {}
    probe = next((r for r in records if r["kind"] == "probe"), None)
    if probe and "context" in probe:
        out["context_idle"] = probe["context"]["device"] - probe["context"]["reserved"]
    if probe and "cublas" in probe:
        out["cublas_in_allocator"] = sum(v["kept_allocated"] for v in probe["cublas"].values())
        out["cublas_outside"] = sum(v["kept_outside"] for v in probe["cublas"].values())
    if probe and "loss_head" in probe:
        out["loss_tokens"], out["loss_vocab"] = (
            probe["loss_head"]["shape"]["tokens"],
            probe["loss_head"]["shape"]["vocab"],
        )
        for phase in ("forward", "backward"):
            out[f"loss_{phase}"] = probe["loss_head"]["measured"][phase]
            out[f"loss_{phase}_predicted"] = probe["loss_head"]["predicted"][phase]
    for key, name in (
        ("outside", "outside"),
        ("allocator_fraction", "allocator"),
        ("reserved_over_allocated", "reserved_ratio"),
    ):
        values = [f[key] for f in figures if f.get(key) is not None]
        if values:
            out[f"{name}_median"], out[f"{name}_max"], out[f"{name}_n"] = (
                statistics.median(values),
                max(values),
                len(values),
            )
    live = [abs(f["live_err"]) for f in figures if "live_err" in f]
    if live:
        out["live_err_median"], out["live_err_max"] = statistics.median(live), max(live)
    return out


def constant_rows(c: dict[str, float], device: str) -> list[str]:
    rows = []
    if "context_idle" in c:
        rows.append(
            f"| CUDA context at idle (NVML − reserved after init) | {gb(model.CUDA_CONTEXT_BYTES)} | {gb(c['context_idle'])} | probe |"
        )
    if "cublas_in_allocator" in c:
        rows.append(
            "| cuBLAS/cuBLASLt workspaces + handles after bf16, fp32 and bias GEMMs: in torch's allocator / outside "
            f"| {gb(model.CUBLAS_WORKSPACE_BYTES)} | {c['cublas_in_allocator'] / 2**20:.0f} MiB / "
            f"{c['cublas_outside'] / 2**20:.0f} MiB | probe |"
        )
    if "outside_max" in c:
        rows.append(
            f"| memory outside torch while training (NVML − reserved at phase ends), median / max of {c['outside_n']} "
            f"points | {gb(model.CUDA_CONTEXT_BYTES)} | {gb(c['outside_median'])} / {gb(c['outside_max'])} | points |"
        )
    if "allocator_max" in c:
        rows.append(
            "| allocator (expandable segments): (reserved − allocated − pages) / predicted transient, median / max "
            f"| {ALLOCATOR_FRACTION_EXPANDABLE:.3f} "
            f"| {c['allocator_median']:.3f} / {c['allocator_max']:.3f} | points |"
        )
        rows.append(
            f"| reserved / allocated − 1 at the peak, median / max | — | {c['reserved_ratio_median']:.3f} / "
            f"{c['reserved_ratio_max']:.3f} | points |"
        )
    where = "Triton" if device == "cuda" else "CPU torch fold"
    for phase in ("forward", "backward"):
        if f"loss_{phase}" in c:
            pred, meas = c[f"loss_{phase}_predicted"], c[f"loss_{phase}"]
            rows.append(
                f"| TRL fused LM head ({where}) alone, {c['loss_tokens']:.0f} tokens × {c['loss_vocab']:.0f} vocab: {phase} working set | {gb(pred)} | {gb(meas)}{err(pred, meas)} | probe |"
            )
    if "live_err_max" in c:
        rows.append(
            f"| live bytes: \\|predicted − measured\\| / measured, median / max | — | {c['live_err_median']:.1%} / "
            f"{c['live_err_max']:.1%} | points |"
        )
    return rows


def suggested(c: dict[str, float]) -> list[str]:
    """estimate.py lines the measurements imply (conservative: the max over points)."""
    lines = []
    if "outside_max" in c:
        lines.append(
            f"CUDA_CONTEXT_BYTES = {c['outside_max']:.4g}  # NVML − reserved while training, max of {c['outside_n']} "
            "points: context, cuBLAS handles, kernel modules, paged states"
        )
    if "cublas_in_allocator" in c:
        lines.append(
            f"CUBLAS_WORKSPACE_BYTES = {c['cublas_in_allocator']:.0f}  # held in torch's allocator after the first "
            "GEMMs (probe): part of allocated/reserved, not of the context"
        )
    if "allocator_max" in c:
        lines.append(
            f"ALLOCATOR_FRACTION_EXPANDABLE = {c['allocator_max']:.3f}  # (reserved − allocated − pages) / predicted "
            "transient, max of "
            f"{c['allocator_n']} points"
        )
    return lines


# -- the document ---------------------------------------------------------------------------------------------------
def header(records: list[dict[str, Any]], smoke: bool) -> list[str]:
    env = next((r for r in records if r["kind"] == "env"), {})
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
    if smoke:
        lines = [
            "# GPU kit: CPU smoke run — NOT GPU figures",
            "",
            "`bash scripts/gpu_check.sh --cpu-smoke` ran every step of the GPU kit end to end on the CPU at toy sizes "
            "(tiny Qwen2 / Llama shapes). It shows the kit works, not how the memory model does on a GPU: the only "
            "measurement is the CPU harness's exact live bytes. The GPU table replaces this file once a device runs "
            '`bash scripts/gpu_check.sh` (docs/development.md, "GPU check").',
        ]
    else:
        lines = [
            "# Memory model vs CUDA measurement",
            "",
            f"Measured by `bash scripts/gpu_check.sh` on {env.get('gpu') or 'a GPU'}; predictions recomputed with the "
            "memory model as committed (`python -m devkit.gpu.check --analyze RESULTS`).",
        ]
    lines += ["", f"Python {env.get('python', '?')}; {versions}."]
    if env.get("unmet"):
        lines += ["", "Unmet requirements on the device: " + "; ".join(env["unmet"]) + "."]
    return lines


POINTS_NOTE = (
    "Allocated is the allocator's peak over two optimizer steps (the second with gradient accumulation 2); reserved "
    "adds its caching; device is the reserved peak plus what NVML sees outside torch at the phase ends (context, "
    "cuBLAS handles, kernels, bitsandbytes' paged states). Target: reserved within 5 %, device never under the "
    "prediction by more than the tier's safety margin."
)
RUNS_NOTE = (
    "predicted: plan.json's live / full peak, in parentheses the same setup with the model as it is now. Reserved "
    "and device peaks from a 20 Hz sampler beside the run (device = NVML − NVML before the run)."
)


def point_section(records: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The harness table, the per-phase table, and each point's figures for the constants."""
    rows, phases, figures = [], [], []
    for rec in (r for r in records if r["kind"] == "point"):
        est = predict_point(rec)
        row, fig = point_row(rec, est)
        rows.append(row)
        figures.append(fig)
        if rec.get("status", "ok") == "ok" and (p := phase_row(rec, est)):
            phases.append(p)
    lines = ["## Estimator harness: real training steps under the --vram cap", "", *POINT_HEADER, *rows]
    lines += ["", POINTS_NOTE, "", "### Per phase (live GB, measured / predicted, steady-state step)", ""]
    lines += ["| model | --vram | adapter | static | forward | backward | optimizer step |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- |", *phases]
    return lines, figures


def constants_section(found: dict[str, float], smoke: bool) -> list[str]:
    lines = [
        "## Implied CUDA constants",
        "",
        "| term | estimate.py now | measured | from |",
        "| --- | --- | --- | --- |",
    ]
    lines += constant_rows(found, "cpu" if smoke else "cuda")
    code = suggested(found)
    if code and not smoke:
        lines += ["", "Suggested `lowmem_ft/memory/estimate.py` values (review before committing):", ""]
        lines += ["```python", *code, "```"]
    return lines


def analyze(path: Path, smoke: bool | None = None) -> str:
    """The markdown document for a results file."""
    records = load(path)
    if smoke is None:
        smoke = any(r["kind"] == "probe" and r.get("device") == "cpu" for r in records)
    points, figures = point_section(records)
    runs = [r for r in records if r["kind"] in ("train", "context")]
    steps = [r for r in records if r["kind"] == "step"]
    lines = [*header(records, smoke), "", *points, "", "## Real runs: `lowmem-ft train`", "", *RUN_HEADER]
    lines += [*map(run_row, runs), "", RUNS_NOTE, "", *constants_section(constants(records, figures), smoke)]
    lines += ["", *published_section(records)]
    lines += ["## Steps", "", "| step | status | seconds | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s.get('detail', '')} |" for s in steps]
    return "\n".join(lines) + "\n"


def write_analysis(path: Path, md: Path) -> int:
    text = analyze(path)
    md.write_text(text, encoding="utf-8")
    start = text.find("## Implied CUDA constants")
    print(text[start:] if start >= 0 else text)
    print(f"wrote {md}")
    return 0
