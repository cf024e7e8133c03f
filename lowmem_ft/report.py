"""The memory report of a run directory: `memory.png` and a console summary, from `memory.jsonl` alone.

The one idea: the plot and the summary are drawn from the run directory (`RunDir.memory_log`, which tolerates the
cut last line of a crashed run), never from a live trainer, so the same code serves the end of `train` and
`lowmem-ft report RUN_DIR` for any run, finished or crashed. Measured peak, the planner's predicted peak, the VRAM and
the budget (VRAM − safety margin) are shown together, in decimal GB. memory.png is drawn to a temporary file and
renamed: a full disk leaves the old plot (or none) and a line saying so, never a 0-byte file.

On the CPU the monitor counts live tensor bytes exactly (`lowmem_ft.train.measure.exact`), and each sample carries the
memory model's prediction for its phase and batch: the report compares the two — "measured peak 25.7 MB,
predicted 26.1 MB (−1.6 %)", error = (measured − predicted) / predicted — at the run's peak and per phase, and draws the
measured curve against the predicted one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lowmem_ft.rundir import MemoryLog, RunDir, unique_tmp

# What "measured peak" means in order of preference: the whole card as NVML sees it, else the allocator's peak,
# else (no CUDA) the exact count of live tensor bytes, else (a memory file from before it) the host's resident set.
PEAK_KEYS = [
    ("device_used_gb", "device used (NVML)"),
    ("peak_gb", "allocator peak"),
    ("peak_live_gb", "exact live tensor bytes"),
    ("rss_gb", "host RSS"),
]
EXACT_LABEL = "exact live tensor bytes"


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
        **({"calibration_gb": header["calibration_gb"]} if header.get("calibration_gb") else {}),
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
    if any("rss_gb" in s for s in samples):
        out["rss_peak_gb"] = max(s["rss_gb"] for s in samples if "rss_gb" in s)
    if out["budget_gb"] is not None and label != EXACT_LABEL:  # the budget is a GPU figure
        out["headroom_gb"] = out["budget_gb"] - top[key]
    exact = compare_exact(header, samples)
    if exact is not None:
        out["exact"] = exact
    return out


def _error(measured: float, predicted: float | None) -> float | None:
    return (measured - predicted) / predicted if predicted else None


def compare_exact(header: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A CPU run's exact measurement against the memory model, or None when it has none.

    `measured_gb` / `predicted_gb`: the highest `peak_live_gb` / `predicted_peak_live_gb` over the samples that carry
    a prediction (forward, backward, optimizer step, evaluation forward — the batches that ran); `error` =
    (measured − predicted) / predicted; the same per phase in `phases`. `outside_gb`: the highest peak of the phases
    without a prediction (checkpoint saves, the end of an evaluation loop), which hold no activation and stay below
    the training peak. `planned_gb`: the prediction for the plan's batch (micro batch × max_seq_len).
    """
    measured = [s for s in samples if "peak_live_gb" in s]
    predicted = [s for s in measured if s.get("predicted_peak_live_gb") is not None]
    if not measured:
        return None
    out: dict[str, Any] = {
        "planned_gb": header.get("predicted_cpu_peak_gb"),
        "planned_batch": header.get("predicted_cpu_batch"),
    }
    if predicted:
        top = max(predicted, key=lambda s: s["peak_live_gb"])
        m, p = top["peak_live_gb"], max(s["predicted_peak_live_gb"] for s in predicted)
        out |= {"measured_gb": m, "predicted_gb": p, "error": _error(m, p), "phase": top["phase"]}
        out |= {"step": top["step"], "batch": top.get("batch")}
        phases: dict[str, dict[str, Any]] = {}
        for s in predicted:
            ph = phases.setdefault(s["phase"], {"measured_gb": 0.0, "predicted_gb": 0.0})
            ph["measured_gb"] = max(ph["measured_gb"], s["peak_live_gb"])
            ph["predicted_gb"] = max(ph["predicted_gb"], s["predicted_peak_live_gb"])
        for ph in phases.values():
            ph["error"] = _error(ph["measured_gb"], ph["predicted_gb"])
        out["phases"] = phases
    outside = [s for s in measured if s.get("predicted_peak_live_gb") is None]
    if outside:
        top = max(outside, key=lambda s: s["peak_live_gb"])
        out |= {"outside_gb": top["peak_live_gb"], "outside_phase": top["phase"]}
    return out


def size(gb: float) -> str:
    """Decimal GB, or MB below 1 GB (the tiny models of a first run weigh megabytes)."""
    return f"{gb:.2f} GB" if gb >= 1 else f"{gb * 1000:.2f} MB"


def percent(x: float) -> str:
    return f"{x * 100:+.1f} %".replace("-", "−")


def _exact_lines(s: dict[str, Any]) -> list[str]:
    """The CPU run's lines: exact measurement against the memory model's CPU form."""
    e = s["exact"]
    if "measured_gb" not in e:
        return [f"memory: measured peak {size(s['measured_peak_gb'])} ({EXACT_LABEL}) in {s['peak_phase']} of step "
                f"{s['peak_step']}; no prediction (the memory model cannot describe this model)"]  # fmt: skip
    batch = f", batch {e['batch'][0]} × {e['batch'][1]} tokens" if e.get("batch") else ""
    lines = [
        f"memory: measured peak {size(e['measured_gb'])}, predicted {size(e['predicted_gb'])} ({percent(e['error'])}) — "
        f"{EXACT_LABEL} on the CPU against the memory model; peak in {e['phase']} of step {e['step']}{batch}",
        "  per phase, measured / predicted: "
        + ", ".join(
            f"{name} {size(ph['measured_gb'])} / {size(ph['predicted_gb'])} ({percent(ph['error'])})"
            for name, ph in e["phases"].items()
        ),
    ]
    if "outside_gb" in e:
        where = "below" if e["outside_gb"] <= e["measured_gb"] else "ABOVE"
        lines.append(
            f"  {e['outside_phase']} (no activations) peaked at {size(e['outside_gb'])}, {where} the training peak"
        )
    if e.get("planned_gb") is not None:
        rows, tokens = e.get("planned_batch") or ("?", "?")
        lines.append(
            f"  the plan's batch ({rows} × {tokens} tokens) is predicted at {size(e['planned_gb'])} on the CPU"
        )
    return lines


def format_summary(summary: dict[str, Any]) -> str:
    if "measured_peak_gb" not in summary:
        return "memory: no samples recorded"
    s = summary
    predicted = s.get("predicted_peak_gb")
    if "exact" in s:
        lines = _exact_lines(s)
        if predicted:
            lines.append(f"  the GPU plan predicts {predicted:.2f} GB with CUDA overheads (context, workspaces)")
        if s.get("rss_peak_gb") is not None:
            lines.append(
                f"  host RSS peak {size(s['rss_peak_gb'])} (Python, libraries, data: outside the memory model)"
            )
    else:
        lines = _measured_lines(s, predicted)
    if s["events"]:
        lines.append("  events: " + ", ".join(f"{k} ×{n}" for k, n in sorted(s["events"].items())))
    gpu_figures = s.get("budget_gb") is not None or predicted
    if s.get("measure") in ("host RSS", EXACT_LABEL) and gpu_figures:
        lines.append("  (no CUDA device: the budget and the GPU plan's peak are GPU figures)")
    return "\n".join(lines)


def _measured_lines(s: dict[str, Any], predicted: float | None) -> list[str]:
    lines = [
        f"memory: measured peak {s['measured_peak_gb']:.2f} GB ({s['measure']}) in {s['peak_phase']} "
        f"of step {s['peak_step']}"
    ]
    if s.get("allocator_peak_gb") is not None and s["measure"] != "allocator peak":
        lines[0] += f"; allocator peak {s['allocator_peak_gb']:.2f} GB"
    if predicted and s["measure"] == "host RSS":  # a GPU prediction is no yardstick for host memory
        lines.append(f"  predicted peak {predicted:.2f} GB (GPU; not comparable without CUDA)")
    elif predicted:
        error = (s["measured_peak_gb"] - predicted) / predicted
        lines.append(f"  predicted peak {predicted:.2f} GB (measured {error:+.1%})")
    else:
        lines.append("  predicted peak: none (the plan gave no prediction)")
    if s.get("budget_gb") is not None and "headroom_gb" in s:
        lines.append(
            f"  budget {s['budget_gb']:g} GB (VRAM {s.get('vram_gb') or 0:g} − safety margin "
            f"{s.get('safety_margin_gb') or 0:g}"
            + (f" − {s['calibration_gb']:g} calibrated on the GPU" if s.get("calibration_gb") else "")
            + f"), headroom at the peak {s['headroom_gb']:.2f} GB"
        )
    return lines


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


def _line(ax, xs, samples, key: str, label: str, **style) -> None:
    points = [(x, s[key]) for x, s in zip(xs, samples, strict=True) if s.get(key) is not None]
    if points:
        ax.plot(*zip(*points, strict=True), label=label, **{"linewidth": 1, **style})


def _draw_device(ax, header: dict[str, Any], xs: list[float], samples: list[dict[str, Any]]) -> None:
    """CUDA allocator and NVML curves (or, in a memory file without exact figures, host RSS) against the plan."""
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
        _line(ax, xs, samples, key, label)
    vram, budget, predicted = header.get("vram_gb"), header.get("budget_gb"), header.get("predicted_peak_gb")
    if vram is not None:
        ax.axhline(vram, color="red", linewidth=1.5, label=f"VRAM {vram:g} GB")
        if budget is not None and budget < vram:
            label = f"safety margin {vram - budget:g} GB above the {budget:g} GB budget"
            ax.axhspan(budget, vram, color="red", alpha=0.12, label=label)
    if predicted is not None:
        ax.axhline(predicted, color="black", linestyle="--", linewidth=1, label=f"predicted peak {predicted:.2f} GB")


def _draw_exact(ax, header: dict[str, Any], xs: list[float], samples: list[dict[str, Any]]):
    """A CPU run: the exact measured curve against the memory model's prediction for the same phases and batches;
    host RSS on its own (right) axis, since Python and the libraries dwarf a small model's tensors. The VRAM and the
    GPU plan are not drawn: they are GPU figures."""
    measured = "measured: exact peak of live tensors since the previous sample"
    _line(ax, xs, samples, "peak_live_gb", measured, color="tab:blue", linewidth=1.5)
    _line(ax, xs, samples, "live_gb", "live tensors at the sample", linestyle=":", color="grey")
    predicted = "predicted: memory model (CPU form), same phase and batch"
    _line(ax, xs, samples, "predicted_peak_live_gb", predicted, linestyle="--", color="black", linewidth=0.8)
    planned = header.get("predicted_cpu_peak_gb")
    if planned is not None:
        rows, tokens = header.get("predicted_cpu_batch") or ("?", "?")
        label = f"predicted peak for the plan's batch ({rows} × {tokens} tokens): {size(planned)}"
        ax.axhline(planned, color="black", linestyle=":", linewidth=1, label=label)
    rss = ax.twinx()
    _line(rss, xs, samples, "rss_gb", "host RSS (right axis)", color="tab:orange", alpha=0.6)
    rss.set_ylabel("host RSS, GB")
    rss.set_ylim(bottom=0)
    return rss


# GRPO's phases beside the training micro-steps (lowmem_ft.train.methods.grpo): marked on the curve where they occur
MARKED_PHASES = {"generation": ("^", "tab:green"), "scoring": ("s", "tab:purple")}


def _mark_phases(ax, xs: list[float], samples: list[dict[str, Any]], key: str) -> None:
    for phase, (marker, color) in MARKED_PHASES.items():
        points = [(x, s[key]) for x, s in zip(xs, samples, strict=True) if s["phase"] == phase and key in s]
        if points:
            ax.scatter(*zip(*points, strict=True), marker=marker, color=color, zorder=3, label=phase)


def plot(header: dict[str, Any], samples: list[dict[str, Any]], events: list[dict[str, Any]], title: str = ""):
    """The memory curve over optimizer steps with budget line, margin band, predicted peak and OOM events; on the
    CPU, the exact measurement against the prediction."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5), dpi=100)
    ax = fig.add_subplot()
    xs = _x(samples)
    exact = not any("allocated_gb" in s for s in samples) and any("peak_live_gb" in s for s in samples)
    second = _draw_exact(ax, header, xs, samples) if exact else None
    if not exact:
        _draw_device(ax, header, xs, samples)
    _mark_phases(ax, xs, samples, "peak_live_gb" if exact else "peak_gb")
    oom_label = {"oom_recovered": "OOM recovered", "oom_fatal": "OOM (stopped)", "margin_action": "margin action"}
    shown: set[str] = set()
    for e in events:
        if e["event"] in oom_label:
            label = oom_label[e["event"]]
            ax.axvline(e["step"] - 0.5, color="purple", linestyle=":", label=None if label in shown else label)
            shown.add(label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("live tensor bytes, GB (1e9 bytes)" if exact else "GB (1e9 bytes)")
    ax.set_title(title or "memory")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if second is not None:  # one legend for both axes, on the upper one so no curve hides it
        more = second.get_legend_handles_labels()
        second.legend(
            handles + more[0], labels + more[1], loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2,
            fontsize="small",
        )  # fmt: skip
    else:
        ax.legend(handles, labels, loc="best", fontsize="small")  # away from the curve and the budget line
    fig.tight_layout()
    return fig


def write_report(run_dir: str | Path, strict: bool = False) -> tuple[Path, str]:
    """Draw the run's memory.png and return (its path, the console summary). The summary starts with the run's
    status (run.json) unless this process is the run, and says so when the plot could not be written — or, `strict`
    (the `report` command), the OSError is raised."""
    run = RunDir(run_dir)
    log: MemoryLog = run.memory_log()
    summary = format_summary(summarize(log.start, log.samples, log.events))
    if log.unreadable:
        summary += f"\n  ({log.unreadable} unreadable line(s) skipped: a run that crashed while writing)"
    status = run.read_status()
    if status is not None and status.pid != os.getpid():
        summary = f"run: {run.describe_status()}\n{summary}"
    fig = plot(log.start, log.samples, log.events, title=f"memory of {run.name}")
    tmp = None
    try:
        tmp = unique_tmp(run.memory_plot)  # the run's own report at its end and a `report` of it may draw at once
        fig.savefig(tmp, format="png")
        os.replace(tmp, run.memory_plot)
    except OSError as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if strict:
            raise
        summary += f"\n  ({run.memory_plot.name} not written: {exc.strerror or exc})"
    return run.memory_plot, summary
