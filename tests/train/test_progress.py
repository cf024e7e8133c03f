"""The progress bar's memory postfix, from the monitor's samples; no bar under --quiet."""

from __future__ import annotations

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from lowmem_ft.memory.target import Target
from lowmem_ft.train.monitor import MemoryMonitor
from lowmem_ft.train.progress import MemoryProgress, memory_postfix


def test_postfix_is_device_memory_against_the_budget_or_host_memory():
    cuda = {"reserved_gb": 5.0, "peak_gb": 5.2, "device_used_gb": 5.6, "rss_gb": 3.0}
    # held = max(reserved, peak) + what NVML sees beyond reserved: 5.2 + 0.6 (monitor.used_gb)
    assert memory_postfix(cuda, Target(24, 1.0)) == "mem 5.80/23.00 GB"
    assert memory_postfix(cuda, None) == "mem 5.80 GB"
    assert memory_postfix({"rss_gb": 0.7512}, Target(8, 1.0)) == "host 0.75 GB"


def test_the_bar_shows_the_steps_highest_sample(tmp_path):
    figures = iter([{"reserved_gb": 4.0}, {"reserved_gb": 6.5}, {"reserved_gb": 5.0}, {"reserved_gb": 3.0}])
    monitor = MemoryMonitor(tmp_path / "memory.jsonl", reader=lambda: next(figures), write=False)
    progress = MemoryProgress(monitor, Target(24, 1.0))
    args, state, control = TrainingArguments(str(tmp_path), report_to=[]), TrainerState(max_steps=2), TrainerControl()
    progress.on_train_begin(args, state, control)
    for phase in ("forward", "backward", "optimizer"):
        monitor.sample(phase)
    state.global_step = 1
    progress.on_step_end(args, state, control)
    assert progress.training_bar.postfix == "mem 6.50/23.00 GB" and progress.training_bar.n == 1
    monitor.sample("forward")  # the next step starts afresh
    state.global_step = 2
    progress.on_step_end(args, state, control)
    assert progress.training_bar.postfix == "mem 3.00/23.00 GB"
    progress.on_train_end(args, state, control)


def _bars(trainer) -> list[type]:
    return [type(c) for c in trainer.callback_handler.callbacks if isinstance(c, (ProgressCallback, PrinterCallback))]


def test_the_trainer_gets_the_memory_bar_and_none_under_quiet(tiny_model, tmp_path, monkeypatch):
    from lowmem_ft import console
    from tests.train.tiny_runs import tiny_trainer

    monkeypatch.setenv(console.QUIET_ENV, "")
    job = tiny_trainer(tiny_model, "examples/chat.jsonl", tmp_path / "normal")
    assert _bars(job.trainer) == [MemoryProgress]
    monkeypatch.setenv(console.QUIET_ENV, "1")
    job = tiny_trainer(tiny_model, "examples/chat.jsonl", tmp_path / "quiet")
    assert _bars(job.trainer) == []
