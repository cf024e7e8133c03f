"""The memory report of a run directory: `memory.png` and a console summary, from `memory.jsonl` alone.

The one idea: the plot and the summary are drawn from the run directory (`RunDir.memory_log`, which tolerates the
cut last line of a crashed run), never from a live trainer, so the same code serves the end of `train` and
`lowmem-ft report RUN_DIR` for any run, finished or crashed. Measured peak, the planner's predicted peak, the VRAM and
the budget (VRAM − safety margin) are shown together, in decimal GB. memory.png is drawn to a temporary file and
renamed: a full disk leaves the old plot (or none) and a line saying so, never a 0-byte file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lowmem_ft.rundir import MemoryLog, RunDir

# What "measured peak" means in order of preference: the whole card as NVML sees it, else the allocator's peak,
# else (no CUDA) the host's resident set.
PEAK_KEYS = [("device_used_gb", "device used (NVML)"), ("peak_gb", "allocator peak"), ("rss_gb", "host RSS")]


def load_memory(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """(start record, samples, events) of a run directory's memory.jsonl."""
    log = RunDir(run_dir).memory_log()
    return log.start, log.samples, log.events


def _peak_key(samples: list[dict[str, Any]]) -> tuple[str, str]:
    for key, label in PEAK_KEYS:
        if any(key in s for s in samples):
            return key, label
    return "rss_gb", "host RSS"


def summarize(header: dict[str, Any], samples: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Measured peak (and where), predicted peak, budget, margin, events by kind."""
    out: dict[str, Any] = {
        "predicted_peak_gb": header.get("predicted_peak_gb"),
        "vram_gb": header.get("vram_gb"),
        "budget_gb": header.get("budget_gb"),
        "safety_margin_gb": header.get("safety_margin_gb"),
        "samples": len(samples),
        "events": {},
    }
    for e in events:
        out["events"][e["event"]] = out["events"].get(e["event"], 0) + 1
    if not samples:
        return out
    key, label = _peak_key(samples)
    top = max((s for s in samples if key in s), key=lambda s: s[key])
    out |= {
        "measure": label,
        "measured_peak_gb": top[key],
        "peak_phase": top["phase"],
        "peak_step": top["step"],
    }
    if any("peak_gb" in s for s in samples):
        out["allocator_peak_gb"] = max(s["peak_gb"] for s in samples if "peak_gb" in s)
    if out["budget_gb"] is not None:
        out["headroom_gb"] = out["budget_gb"] - top[key]
    return out


def format_summary(summary: dict[str, Any]) -> str:
    if "measured_peak_gb" not in summary:
        return "memory: no samples recorded"
    s = summary
    lines = [
        f"memory: measured peak {s['measured_peak_gb']:.2f} GB ({s['measure']}) in {s['peak_phase']} "
        f"of step {s['peak_step']}"
    ]
    if s.get("allocator_peak_gb") is not None and s["measure"] != "allocator peak":
        lines[0] += f"; allocator peak {s['allocator_peak_gb']:.2f} GB"
    predicted = s.get("predicted_peak_gb")
    if predicted and s["measure"] == "host RSS":  # a GPU prediction is no yardstick for host memory
        lines.append(f"  predicted peak {predicted:.2f} GB (GPU; not comparable without CUDA)")
    elif predicted:
        error = (s["measured_peak_gb"] - predicted) / predicted
        lines.append(f"  predicted peak {predicted:.2f} GB (measured {error:+.1%})")
    else:
        lines.append("  predicted peak: none (the plan gave no prediction)")
    if s.get("budget_gb") is not None:
        lines.append(
            f"  budget {s['budget_gb']:g} GB (VRAM {s.get('vram_gb') or 0:g} − safety margin "
            f"{s.get('safety_margin_gb') or 0:g}), headroom at the peak {s['headroom_gb']:.2f} GB"
        )
    if s["events"]:
        lines.append("  events: " + ", ".join(f"{k} ×{n}" for k, n in sorted(s["events"].items())))
    if s.get("measure") == "host RSS":
        lines.append("  (no CUDA device: host memory only; predicted peak and budget are GPU figures)")
    return "\n".join(lines)


def _x(samples: list[dict[str, Any]]) -> list[float]:
    """Samples spread evenly inside their optimizer step, so forward/backward/optimizer show as a sawtooth."""
    counts: dict[int, int] = {}
    for s in samples:
        counts[s["step"]] = counts.get(s["step"], 0) + 1
    seen: dict[int, int] = {}
    xs = []
    for s in samples:
        k = seen[s["step"]] = seen.get(s["step"], 0) + 1
        xs.append(s["step"] - 1 + k / counts[s["step"]])
    return xs


def plot(header: dict[str, Any], samples: list[dict[str, Any]], events: list[dict[str, Any]], title: str = ""):
    """The memory curve over optimizer steps with budget line, margin band, predicted peak and OOM events."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5), dpi=100)
    ax = fig.add_subplot()
    xs = _x(samples)
    cuda = any("allocated_gb" in s for s in samples)
    curves = (
        [
            ("allocated_gb", "allocated"),
            ("peak_gb", "peak since previous sample"),
            ("reserved_gb", "reserved"),
            ("device_used_gb", "device used (NVML)"),
        ]
        if cuda
        else [("rss_gb", "host RSS (no CUDA)")]
    )
    for key, label in curves:
        points = [(x, s[key]) for x, s in zip(xs, samples, strict=True) if key in s]
        if points:
            ax.plot(*zip(*points, strict=True), label=label, linewidth=1)
    vram, budget, predicted = header.get("vram_gb"), header.get("budget_gb"), header.get("predicted_peak_gb")
    if vram is not None:
        ax.axhline(vram, color="red", linewidth=1.5, label=f"VRAM {vram:g} GB")
        if budget is not None and budget < vram:
            label = f"safety margin {vram - budget:g} GB above the {budget:g} GB budget"
            ax.axhspan(budget, vram, color="red", alpha=0.12, label=label)
    if predicted is not None:
        ax.axhline(predicted, color="black", linestyle="--", linewidth=1, label=f"predicted peak {predicted:.2f} GB")
    oom_label = {"oom_recovered": "OOM recovered", "oom_fatal": "OOM (stopped)", "margin_action": "margin action"}
    shown: set[str] = set()
    for e in events:
        if e["event"] in oom_label:
            label = oom_label[e["event"]]
            ax.axvline(
                e["step"] - 0.5,
                color="purple",
                linestyle=":",
                label=None if label in shown else label,
            )
            shown.add(label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GB (1e9 bytes)")
    ax.set_title(title or "memory")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")  # away from the curve and the budget line
    fig.tight_layout()
    return fig


def write_report(run_dir: str | Path) -> tuple[Path, str]:
    """Draw the run's memory.png and return (its path, the console summary). The summary starts with the run's
    status (run.json) unless this process is the run, and says so when the plot could not be written."""
    run = RunDir(run_dir)
    log: MemoryLog = run.memory_log()
    summary = format_summary(summarize(log.start, log.samples, log.events))
    if log.unreadable:
        summary += f"\n  ({log.unreadable} unreadable line(s) skipped: a run that crashed while writing)"
    status = run.read_status()
    if status is not None and status.pid != os.getpid():
        summary = f"run: {run.describe_status()}\n{summary}"
    fig = plot(log.start, log.samples, log.events, title=f"memory of {run.name}")
    tmp = run.memory_plot.with_name(f".{run.memory_plot.name}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, run.memory_plot)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        summary += f"\n  ({run.memory_plot.name} not written: {exc.strerror or exc})"
    return run.memory_plot, summary
