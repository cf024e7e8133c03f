"""The training progress bar with the memory in use against the budget, or none with `--quiet`.

The Trainer's own tqdm bar (`ProgressCallback`) stays: `MemoryProgress` is that callback with a postfix such as
`mem 5.21/23.00 GB` — the most memory any sample of the step held (`monitor.used_gb`: the allocator's high-water
mark plus what NVML sees beyond it) over the budget (VRAM − margin). Without CUDA it shows the host's resident set,
the one figure the monitor has there, as `host 0.75 GB` (the budget is a GPU figure). It reads the monitor's samples
through `MemoryMonitor.watch`; it measures nothing itself.
"""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import PrinterCallback, ProgressCallback

from lowmem_ft.console import quiet
from lowmem_ft.memory.target import Target
from lowmem_ft.train.monitor import MemoryMonitor, used_gb


def memory_postfix(sample: dict[str, Any], target: Target | None) -> str:
    """The bar's memory text for one sample: device memory against the budget, or host memory without CUDA."""
    used = used_gb(sample)
    if used is None:
        return f"host {sample.get('rss_gb', 0.0):.2f} GB"
    if target is None:
        return f"mem {used:.2f} GB"
    return f"mem {used:.2f}/{target.budget_gb:.2f} GB"


class MemoryProgress(ProgressCallback):
    """transformers' progress bar, showing after each step the step's highest memory against the budget."""

    def __init__(self, monitor: MemoryMonitor, target: Target | None):
        super().__init__()
        self.target = target
        self._top: dict[str, Any] | None = None  # the sample of this step that held the most
        monitor.watch(self._see)

    def _see(self, sample: dict[str, Any]) -> None:
        def held(s: dict[str, Any]) -> float:
            used = used_gb(s)
            return used if used is not None else s.get("rss_gb", 0.0)

        if self._top is None or held(sample) > held(self._top):
            self._top = sample

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and self._top is not None:
            self.training_bar.set_postfix_str(memory_postfix(self._top, self.target), refresh=False)
        self._top = None
        super().on_step_end(args, state, control, **kwargs)  # updates (and redraws) the bar


def install(trainer, monitor: MemoryMonitor, target: Target | None) -> None:
    """Replace the trainer's progress bar with `MemoryProgress`, or drop bar and log lines under `--quiet` (the run's
    losses are still in log_history.jsonl and the trackers)."""
    bar = trainer.pop_callback(ProgressCallback)  # None in a notebook (its own bar) or with disable_tqdm
    if quiet():
        trainer.pop_callback(PrinterCallback)
    elif bar is not None:
        trainer.add_callback(MemoryProgress(monitor, target))
