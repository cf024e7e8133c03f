"""The memory monitor: samples, watchers, leak warning (synthetic readings), a crashed run's file, and W&B offline
metrics."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lowmem_ft.memory.target import Target
from lowmem_ft.rundir import RunDir
from lowmem_ft.train.observe.monitor import LEAK_STEPS, MemoryMonitor, MemoryReader, growth, used_gb


def cuda_like(allocated: float, reserved: float, peak: float | None = None, used: float | None = None) -> dict:
    return {
        "allocated_gb": allocated,
        "reserved_gb": reserved,
        "peak_gb": allocated if peak is None else peak,
        "fragmentation_gb": reserved - allocated,
        "device_used_gb": reserved + 0.5 if used is None else used,
        "device_total_gb": 80.0,
        "rss_gb": 3.0,
    }


class Script:
    """A reader that returns the next scripted sample."""

    def __init__(self, samples):
        self.samples = list(samples)

    def __call__(self):
        return self.samples.pop(0)


def monitor_with(tmp_path, samples, **kw) -> MemoryMonitor:
    monitor = MemoryMonitor(RunDir(tmp_path).memory_file(), reader=Script(samples), **kw)
    monitor.state = SimpleNamespace(global_step=0)
    return monitor


def records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]


def test_reader_without_cuda_reports_host_memory_only():
    sample = MemoryReader()()
    assert set(sample) == {"rss_gb"} and 0.01 < sample["rss_gb"] < 64


def test_used_counts_allocator_high_water_and_memory_outside_it():
    # held: max(reserved 6, peak 7) = 7; NVML sees 1.5 beyond reserved (context, other processes)
    assert used_gb(cuda_like(5, 6, peak=7, used=7.5)) == pytest.approx(8.5)
    assert used_gb({"rss_gb": 1.0}) is None
    assert growth(cuda_like(5, 9), cuda_like(5, 6))[0].startswith("allocator fragmentation")
    assert growth(cuda_like(8, 9), cuda_like(5, 6))[0] == "allocated tensors"


def test_watchers_see_every_sample_and_tags_ride_on_them(tmp_path):
    seen = []
    monitor = monitor_with(tmp_path, [cuda_like(5.0, 6.0), cuda_like(5.0, 7.0)], target=Target(10.0, 1.0))
    monitor.watch(seen.append)
    monitor.sample("forward")
    monitor.tag(micro_batch=2)
    monitor.sample("backward")
    monitor.close()
    assert [s["phase"] for s in seen] == ["forward", "backward"]
    assert [r.get("micro_batch") for r in records(tmp_path)] == [None, 2]
    assert monitor.headroom_gb(seen[1]) == pytest.approx(9.0 - 7.5)  # budget (VRAM − margin) − used
    assert monitor.events == []  # the monitor observes; deciding is the guard's (tests/train/resilience/test_guard.py)


def test_a_crashed_runs_memory_file_still_reads(tmp_path):
    """`report` used to raise JSONDecodeError on the line a crash cut short."""
    from lowmem_ft import cli

    samples = [cuda_like(5.0, 6.0)] * 2  # the start record reads once too
    monitor = monitor_with(tmp_path, samples, target=Target(8.0, 1.0), predicted_peak_gb=5.0)
    monitor.on_train_begin(None, SimpleNamespace(global_step=0), None)
    monitor.sample("forward")
    monitor.close()
    with RunDir(tmp_path).memory_file().open("a") as handle:
        handle.write('{"step": 1, "phase": "backw')  # the crash
    log = RunDir(tmp_path).memory_log()
    assert len(log.samples) == 1 and log.unreadable == 1
    assert log.start["budget_gb"] == 7.0 and log.start["vram_gb"] == 8.0
    assert cli.main(["report", str(tmp_path)]) == 0


def test_old_memory_files_are_read_in_the_current_meaning(tmp_path):
    """Before budget_gb meant VRAM − margin everywhere, memory.jsonl's budget_gb was the VRAM itself."""
    path = RunDir(tmp_path).memory_file()
    path.write_text(json.dumps({"event": "start", "step": 0, "budget_gb": 24, "safety_margin_gb": 1.5}) + "\n")
    start = RunDir(tmp_path).memory_log().start
    assert (start["vram_gb"], start["budget_gb"]) == (24, 22.5)


def run_steps(monitor, allocated_by_step):
    args = control = None
    for step, allocated in enumerate(allocated_by_step):
        monitor.state.global_step = step
        monitor.sample("forward")
        monitor.on_optimizer_step(args, monitor.state, control)
        monitor.state.global_step = step + 1
        monitor.on_step_end(args, monitor.state, control)
        del allocated


def leak_monitor(tmp_path, optimizer_allocated):
    samples = []
    for a in optimizer_allocated:
        samples += [cuda_like(4.0, 6.0), cuda_like(a, 6.0)]  # forward flat, optimizer as given
    return monitor_with(tmp_path, samples, target=Target(80.0, 1.0))


def test_leak_warning_when_allocated_grows_every_step_at_one_phase(tmp_path):
    growing = [2.0 + 0.02 * i for i in range(LEAK_STEPS + 2)]
    monitor = leak_monitor(tmp_path, growing)
    run_steps(monitor, growing)
    leaks = [e for e in monitor.events if e["event"] == "leak"]
    assert len(leaks) == 1 and leaks[0]["phase"] == "optimizer"  # once, and not for the flat forward
    assert leaks[0]["step"] == LEAK_STEPS + 1


def test_no_leak_warning_for_noise_or_small_growth(tmp_path):
    noisy = [2.0, 2.1, 2.05, 2.2, 2.1, 2.3, 2.2, 2.4, 2.3, 2.5, 2.4]  # grows, but not step after step
    small = [2.0 + 0.001 * i for i in range(LEAK_STEPS + 2)]  # step after step, but under LEAK_MIN_GB
    for name, series in (("noisy", noisy), ("small", small)):
        monitor = leak_monitor(tmp_path / name, series)
        run_steps(monitor, series)
        assert monitor.events == [], name


@pytest.mark.slow
def test_wandb_offline_run_holds_memory_metrics_and_plan(tiny_model, tmp_path, monkeypatch):
    import torch

    from devkit.wandb_offline import find as find_offline_run
    from tests.train.tiny_runs import tiny_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = tiny_run(
            tiny_model,
            "tests/data/numbered.jsonl",
            tmp_path / "runs",
            "wb",
            "training.max_steps=2",
            choice={"vram_gb": 8, "predicted_peak_gb": 5.5, "safety_margin_gb": 1.0},
        )
    finally:
        torch.set_num_threads(threads)
    assert result.metrics["wandb_mode"] == "offline"
    # devkit.wandb_offline waits until the run file holds W&B's exit record: wandb.finish() can return while
    # wandb-core still buffers the last records
    offline = find_offline_run(tmp_path)  # WANDB_DIR
    history, config, summary = offline.history, offline.config, offline.summary
    memory_rows = [h for h in history if "memory/rss_gb" in h]
    assert [h["train/global_step"] for h in memory_rows] == [1, 2]
    assert all(0 < h["memory/rss_gb"] < 64 and h["memory/micro_batch"] == 4 for h in memory_rows)
    assert config["memory/predicted_peak_gb"] == 5.5 and config["memory/vram_gb"] == 8
    assert config["memory/budget_gb"] == 7 and config["memory/safety_margin_gb"] == 1.0
    assert summary["memory/predicted_peak_gb"] == 5.5
    assert summary["memory/peak_phase"] in ("forward", "backward", "optimizer", "save")
    phases = {r.get("phase") for r in map(json.loads, (result.run_dir / "memory.jsonl").read_text().splitlines())}
    assert {"forward", "backward", "optimizer"} <= phases
    assert (result.run_dir / "memory.png").stat().st_size > 10_000


@pytest.mark.slow
def test_cpu_run_counts_live_tensors_exactly_at_every_sample(tiny_model, tmp_path, capsys):
    """On the CPU every sample of a real run carries exact live bytes and the prediction for its phase and batch;
    the start record the CPU form's peak for the plan's batch; the console line compares them (agreement within
    8 % is checked for this and every run by tests/conftest.py)."""
    from tests.train.tiny_runs import memory_records, tiny_run

    result = tiny_run(tiny_model, "tests/data/numbered.jsonl", tmp_path, "exact", "training.max_steps=2")
    start, *rest = memory_records(result.run_dir)
    assert start["exact"] and start["predicted_cpu_batch"] == [4, 48] and start["predicted_cpu_peak_gb"] > 0
    samples = {r["phase"]: r for r in rest if "phase" in r}
    for phase in ("forward", "backward", "optimizer"):
        s = samples[phase]
        assert 0 < s["live_gb"] <= s["peak_live_gb"] and s["predicted_peak_live_gb"] > 0, phase
    assert samples["forward"]["batch"][0] == 4 and samples["forward"]["batch"][1] <= 48
    assert samples["forward"]["peak_live_gb"] > 2 * samples["optimizer"]["live_gb"]  # activations and the loss
    assert "predicted_peak_live_gb" not in samples["save"]
    out = capsys.readouterr().out
    assert "memory: measured peak " in out and ", predicted " in out and "exact live tensor bytes" in out
