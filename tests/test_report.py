"""memory.png and the memory summary from a memory.jsonl (synthetic CUDA figures and a CPU one)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.colors import to_rgba
from matplotlib.patches import Polygon, Rectangle

from lowmem_ft.report import format_summary, load_memory, plot, summarize, write_report


def write_memory(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def cuda_run(run_dir):
    start = {"event": "start", "step": 0, "predicted_peak_gb": 17.5, "vram_gb": 24, "safety_margin_gb": 1.5,
             "budget_gb": 22.5}  # fmt: skip
    records = [start]
    for step in (1, 2, 3):
        for phase, alloc, peak in (("forward", 12, 15), ("backward", 9, 18 if step == 2 else 16), ("optimizer", 8, 9)):
            records.append(
                {
                    "step": step,
                    "phase": phase,
                    "allocated_gb": alloc,
                    "reserved_gb": 19,
                    "peak_gb": peak,
                    "fragmentation_gb": 19 - alloc,
                    "device_used_gb": 19.6,
                    "rss_gb": 4,
                }
            )
    records.insert(5, {"event": "oom_recovered", "step": 2, "message": "x"})
    write_memory(run_dir, records)


def test_summary_compares_measured_predicted_budget(tmp_path):
    cuda_run(tmp_path)
    s = summarize(*load_memory(tmp_path))
    assert s["measure"] == "device used (NVML)" and s["measured_peak_gb"] == 19.6
    assert s["allocator_peak_gb"] == 18 and s["headroom_gb"] == pytest.approx(22.5 - 19.6)
    assert s["events"] == {"oom_recovered": 1}
    text = format_summary(s)
    assert "measured peak 19.60 GB (device used (NVML)) in forward of step 1; allocator peak 18.00 GB" in text
    assert "predicted peak 17.50 GB (measured +12.0%)" in text
    assert "budget 22.5 GB (VRAM 24 − safety margin 1.5), headroom at the peak 2.90 GB" in text
    # a GPU's calibration took from the budget (lowmem_ft.calibrated): the line's arithmetic says so
    header, samples, events = load_memory(tmp_path)
    header = {**header, "calibration_gb": 0.4, "budget_gb": 22.1}
    text = format_summary(summarize(header, samples, events))
    assert "budget 22.1 GB (VRAM 24 − safety margin 1.5 − 0.4 calibrated on the GPU), headroom" in text


def test_plot_draws_curves_budget_margin_prediction_and_events(tmp_path):
    cuda_run(tmp_path)
    fig = plot(*load_memory(tmp_path))
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert {"allocated", "peak since previous sample", "reserved", "device used (NVML)"} <= lines.keys()
    assert list(lines["allocated"].get_ydata()) == [12, 9, 8] * 3
    assert list(lines["allocated"].get_xdata())[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])  # inside step 1
    assert set(lines["VRAM 24 GB"].get_ydata()) == {24}
    assert set(lines["predicted peak 17.50 GB"].get_ydata()) == {17.5}
    assert lines["predicted peak 17.50 GB"].get_linestyle() == "--"
    assert set(lines["OOM recovered"].get_xdata()) == {1.5}  # before step 2
    (band,) = [p for p in ax.patches if p.get_label() == "safety margin 1.5 GB above the 22.5 GB budget"]
    assert isinstance(band, (Polygon, Rectangle))
    extent = band.get_extents().transformed(ax.transData.inverted())
    assert extent.y0 == pytest.approx(22.5) and extent.y1 == pytest.approx(24)
    assert band.get_facecolor()[:3] == to_rgba("red")[:3]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "VRAM 24 GB" in legend and "predicted peak 17.50 GB" in legend
    assert "safety margin 1.5 GB above the 22.5 GB budget" in legend


def test_write_report_saves_a_valid_png(tmp_path):
    cuda_run(tmp_path)
    png, text = write_report(tmp_path)
    assert png == tmp_path / "memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (500, 1000) and image.std() > 0.01  # 10×5 in at 100 dpi, not blank
    assert text.startswith("memory: measured peak")


def test_the_summary_starts_with_the_runs_status(tmp_path):
    from lowmem_ft.rundir import RunDir, RunStatus

    cuda_run(tmp_path)
    status = RunStatus(
        "interrupted", pid=1, step=7, reason="interrupted by SIGINT: stopped after step 7", signal="SIGINT"
    )
    RunDir(tmp_path).write_status(status)
    _, text = write_report(tmp_path)
    assert text.splitlines()[0] == "run: interrupted at step 7 (SIGINT)"
    RunDir(tmp_path).write_status(RunStatus("failed", pid=1, step=3, reason="disk full while saving checkpoint-3"))
    assert write_report(tmp_path)[1].splitlines()[0] == "run: failed at step 3: disk full while saving checkpoint-3"


def test_a_plot_that_cannot_be_written_leaves_no_empty_file(tmp_path, monkeypatch):
    """Disk full at the end of a run used to leave a 0-byte memory.png (the figure is drawn to a temporary file and
    renamed). The writer is patched to fail as a full disk does, after writing part of the file."""
    import errno

    from matplotlib.figure import Figure

    cuda_run(tmp_path)
    write_report(tmp_path)
    before = (tmp_path / "memory.png").read_bytes()

    def full(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    png, text = write_report(tmp_path)
    assert text.endswith("(memory.png not written: No space left on device)")
    assert png.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.jsonl", "memory.png"]  # the old plot, no temp file


def test_cpu_run_plots_host_memory_and_says_so(tmp_path):
    write_memory(
        tmp_path,
        [
            {
                "event": "start",
                "step": 0,
                "predicted_peak_gb": None,
                "vram_gb": 8,
                "budget_gb": 7,
                "safety_margin_gb": 1,
            },
            {"step": 1, "phase": "forward", "rss_gb": 0.5},
            {"step": 1, "phase": "backward", "rss_gb": 0.6},
        ],
    )
    header, samples, events = load_memory(tmp_path)
    labels = [line.get_label() for line in plot(header, samples, events).axes[0].get_lines()]
    assert labels == ["host RSS (no CUDA)", "VRAM 8 GB"]
    text = format_summary(summarize(header, samples, events))
    assert "0.60 GB (host RSS) in backward of step 1" in text and "no CUDA device" in text
    assert "predicted peak: none" in text


def exact_cpu_run(run_dir):
    start = {"event": "start", "step": 0, "predicted_peak_gb": 0.58, "vram_gb": 8, "safety_margin_gb": 0.75,
             "budget_gb": 7.25, "exact": True, "predicted_cpu_peak_gb": 0.0122, "predicted_cpu_batch": [2, 64]}  # fmt: skip
    records = [start]
    for step, tokens in ((1, 49), (2, 40)):
        scale = tokens / 49
        for phase, measured, predicted in (("forward", 0.0086, 0.00857), ("backward", 0.0094, 0.00945),
                                           ("optimizer", 0.00057, 0.00055)):  # fmt: skip
            if phase != "optimizer":
                measured, predicted = measured * scale, predicted * scale
            records.append({"step": step, "phase": phase, "rss_gb": 0.7, "live_gb": 0.0005, "peak_live_gb": measured,
                            "predicted_peak_live_gb": predicted} | ({"batch": [2, tokens]} if phase != "optimizer" else {}))  # fmt: skip
    records.append({"step": 2, "phase": "save", "rss_gb": 0.72, "live_gb": 0.0005, "peak_live_gb": 0.00056})
    write_memory(run_dir, records)


def test_cpu_summary_compares_exact_measurement_with_the_memory_model(tmp_path):
    exact_cpu_run(tmp_path)
    s = summarize(*load_memory(tmp_path))
    assert s["measure"] == "exact live tensor bytes" and s["measured_peak_gb"] == 0.0094
    e = s["exact"]
    assert (e["measured_gb"], e["predicted_gb"], e["phase"], e["step"], e["batch"]) == (
        0.0094,
        0.00945,
        "backward",
        1,
        [2, 49],
    )
    assert e["error"] == pytest.approx(-0.005 / 0.945)
    assert e["phases"]["optimizer"]["error"] == pytest.approx(0.02 / 0.55)
    assert (e["outside_phase"], e["outside_gb"]) == ("save", 0.00056)
    text = format_summary(s)
    first = text.splitlines()[0]
    assert first.startswith("memory: measured peak 9.40 MB, predicted 9.45 MB (−0.5 %)")
    assert "peak in backward of step 1, batch 2 × 49 tokens" in first
    assert "optimizer 0.57 MB / 0.55 MB (+3.6 %)" in text
    assert "save (no activations) peaked at 0.56 MB, below the training peak" in text
    assert "the plan's batch (2 × 64 tokens) is predicted at 12.20 MB on the CPU" in text
    assert "the GPU plan predicts 0.58 GB with CUDA overheads" in text and "host RSS peak 720.00 MB" in text
    assert "headroom" not in text  # the budget is a GPU figure


def test_cpu_plot_draws_measured_against_predicted_and_rss_on_its_own_axis(tmp_path):
    exact_cpu_run(tmp_path)
    fig = plot(*load_memory(tmp_path))
    ax, rss = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    measured = lines["measured: exact peak of live tensors since the previous sample"]
    predicted = lines["predicted: memory model (CPU form), same phase and batch"]
    assert len(measured.get_xdata()) == 7 and len(predicted.get_xdata()) == 6  # the save has no prediction
    assert predicted.get_linestyle() == "--"
    assert set(lines["predicted peak for the plan's batch (2 × 64 tokens): 12.20 MB"].get_ydata()) == {0.0122}
    assert not any(label.startswith("VRAM") for label in lines)  # GPU figures are not drawn for a CPU run
    assert [line.get_label() for line in rss.get_lines()] == ["host RSS (right axis)"]
    legend = [t.get_text() for t in rss.get_legend().get_texts()]
    assert "host RSS (right axis)" in legend and measured.get_label() in legend


def _running(run_dir):
    """A run still going: its lock held (by another RunDir object: flock is per open file) and a memory log whose
    last line the monitor is in the middle of writing."""
    from lowmem_ft.rundir import RunDir, RunStatus

    cuda_run(run_dir)
    holder = RunDir(run_dir)
    holder.lock()
    holder.write_status(RunStatus("running", pid=1, host="h", started_at="t"))
    with (run_dir / "memory.jsonl").open("a") as handle:
        handle.write('{"step": 4, "phase": "forw')  # no newline yet
    return holder


def test_report_of_a_running_run_reads_its_complete_lines_only(tmp_path, capsys):
    """Issue #24: `report` on a run still training counted the line being written as unreadable and said the run had
    crashed while writing it."""
    from lowmem_ft.cli import main

    holder = _running(tmp_path)
    try:
        assert main(["report", str(tmp_path)]) == 0
    finally:
        holder.unlock()
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "run: running (pid 1 on h, since t)"
    assert "unreadable" not in out and "crashed" not in out
    # the same file once the run is gone (the lock free): the cut line is what a crash left
    _, text = write_report(tmp_path)
    assert "(1 unreadable line(s) skipped: a run that crashed while writing)" in text


def test_two_reports_at_once_both_write_the_plot(tmp_path, monkeypatch):
    """The run's own report at its end and a `lowmem-ft report` of it drew into the same temporary file: the second
    rename found it gone (or renamed the other's half-written figure). Here both are inside savefig at once."""
    import threading

    from matplotlib.figure import Figure

    cuda_run(tmp_path)
    both_in, savefig = threading.Barrier(2, timeout=30), Figure.savefig

    def together(self, fname, **kwargs):
        both_in.wait()
        savefig(self, fname, **kwargs)
        both_in.wait()

    monkeypatch.setattr(Figure, "savefig", together)
    texts = []
    threads = [threading.Thread(target=lambda: texts.append(write_report(tmp_path)[1])) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(texts) == 2 and not any("not written" in t for t in texts), texts
    assert matplotlib.image.imread(tmp_path / "memory.png").shape[0] > 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.jsonl", "memory.png"]
