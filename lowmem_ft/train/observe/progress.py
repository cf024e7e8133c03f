"""What a run prints while it trains: the progress bar with the memory in use, a compact line per logging step, and
the done line (`done_line`: steps, loss, the method's own figures, throughput) — or nothing but the summary with
`--quiet`.

The Trainer's own tqdm bar (`ProgressCallback`) stays: `MemoryProgress` is that callback with a postfix such as
`mem 5.21/23.00 GB` — the most memory any sample of the step held (`monitor.used_gb`: the allocator's high-water
mark plus what NVML sees beyond it) over the budget (VRAM − margin). Without CUDA it shows the host's resident set,
the one figure the monitor has there, as `host 0.75 GB` (the budget is a GPU figure). It reads the monitor's samples
through `MemoryMonitor.watch`; it measures nothing itself.

In place of the Trainer's raw `{'loss': '6.224', 'grad_norm': …}` dictionaries it writes one line per logging step
(`train_line`: step, loss, learning rate, grad norm, tokens/s since the previous line, the highest memory since then)
and one per evaluation (`eval_line`); every figure still goes to `log_history.jsonl` and the trackers unchanged. A
method's own metrics (SFT's token accuracy; a preference method's reward margin) are shown by the names it passes
(`shown`: log key → label), so the line is the same for every method.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from transformers.trainer_callback import PrinterCallback, ProgressCallback

from lowmem_ft.console import quiet
from lowmem_ft.memory.target import Target
from lowmem_ft.train.observe.monitor import MemoryMonitor, used_gb

# The metrics SFT shows beside the common ones (TRL's SFTTrainer logs them): log key → label.
SFT_SHOWN = {"mean_token_accuracy": "acc"}


def memory_postfix(sample: dict[str, Any], target: Target | None) -> str:
    """The bar's memory text for one sample: device memory against the budget, or host memory without CUDA."""
    used = used_gb(sample)
    if used is None:
        return f"host {sample.get('rss_gb', 0.0):.2f} GB"
    if target is None:
        return f"mem {used:.2f} GB"
    return f"mem {used:.2f}/{target.budget_gb:.2f} GB"


def _held(sample: dict[str, Any]) -> float:
    used = used_gb(sample)
    return used if used is not None else sample.get("rss_gb", 0.0)


def _num(value: Any, fmt: str) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return "nan" if isinstance(value, float) and math.isnan(value) else format(value, fmt)


def train_line(
    logs: Mapping[str, Any],
    step: int,
    max_steps: int,
    *,
    tokens_per_s: float | None = None,
    memory: str | None = None,
    shown: Mapping[str, str] = SFT_SHOWN,
) -> str:
    """One logging step as a line: `step 10/100  loss 1.2345  lr 2.00e-04  grad 0.71  1,234 tok/s  mem …  acc 0.52`."""
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    if "loss" in logs:
        parts.append(f"loss {_num(logs['loss'], '.4f')}")
    if "learning_rate" in logs:
        parts.append(f"lr {_num(logs['learning_rate'], '.2e')}")
    if "grad_norm" in logs:
        parts.append(f"grad {_num(logs['grad_norm'], '.3g')}")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} tok/s")
    if memory:
        parts.append(memory)
    parts += [f"{label} {_num(logs[key], '.4g')}" for key, label in shown.items() if key in logs]
    return "  ".join(parts)


def eval_line(logs: Mapping[str, Any], step: int, memory: str | None = None) -> str:
    """One evaluation as a line: `eval at step 50  loss 1.2345  ppl 3.44  12.3 s`."""
    parts = [f"eval at step {step}"]
    if "eval_loss" in logs:
        parts.append(f"loss {_num(logs['eval_loss'], '.4f')}")
    if "eval_perplexity" in logs:
        parts.append(f"ppl {_num(logs['eval_perplexity'], '.4g')}")
    if "eval_runtime" in logs:
        parts.append(f"{_num(logs['eval_runtime'], '.1f')} s")
    if memory:
        parts.append(memory)
    return "  ".join(parts)


def tokens_per_second(metrics: Mapping[str, Any], history: list[dict[str, Any]]) -> float | None:
    """The run's throughput for the done line: tokens the trainer counted (TRL's `num_tokens`, this process's run
    only, as `train_runtime` is) over its wall time."""
    runtime = metrics.get("train_runtime")
    tokens = next((h["num_tokens"] for h in reversed(history) if isinstance(h.get("num_tokens"), int | float)), None)
    if not tokens or not isinstance(runtime, int | float) or runtime <= 0:
        return None
    return tokens / runtime


class MemoryProgress(ProgressCallback):
    """transformers' progress bar, showing after each step the step's highest memory against the budget, and a
    compact line per log (`train_line`, `eval_line`) in place of the raw dictionaries."""

    def __init__(self, monitor: MemoryMonitor, target: Target | None, shown: Mapping[str, str] = SFT_SHOWN):
        super().__init__()
        self.target = target
        self.shown = dict(shown)
        self._top: dict[str, Any] | None = None  # the sample of this step that held the most
        self._top_since_log: dict[str, Any] | None = None  # … and since the previous line
        self._last: tuple[float, float] = (time.time(), 0.0)  # (time, tokens counted) at the previous line
        self.lines: list[str] = []  # what was written (tests read it)
        monitor.watch(self._see)

    def _see(self, sample: dict[str, Any]) -> None:
        if self._top is None or _held(sample) > _held(self._top):
            self._top = sample
        if self._top_since_log is None or _held(sample) > _held(self._top_since_log):
            self._top_since_log = sample

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self._last = (time.time(), 0.0)  # TRL counts tokens from 0 in each process, also after --resume

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and self._top is not None:
            self.training_bar.set_postfix_str(memory_postfix(self._top, self.target), refresh=False)
        self._top = None
        super().on_step_end(args, state, control, **kwargs)  # updates (and redraws) the bar

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        line = self.line(logs, state.global_step, state.max_steps)
        if line:
            self.lines.append(line)
            self.training_bar.write(line)

    def line(self, logs: Mapping[str, Any], step: int, max_steps: int) -> str | None:
        """The line for one log record, or None for the end-of-training summary (the done line says it)."""
        memory = memory_postfix(self._top_since_log, self.target) if self._top_since_log is not None else None
        if any(k.startswith("eval_") for k in logs):
            return eval_line(logs, step, memory)
        if "train_runtime" in logs:
            return None
        now, tokens = time.time(), logs.get("num_tokens")
        rate = None
        if isinstance(tokens, int | float) and now > self._last[0]:
            rate = (tokens - self._last[1]) / (now - self._last[0])
            self._last = (now, float(tokens))
        self._top_since_log = None
        return train_line(logs, step, max_steps, tokens_per_s=rate, memory=memory, shown=self.shown)


def install(trainer, monitor: MemoryMonitor, target: Target | None, shown: Mapping[str, str] = SFT_SHOWN) -> None:
    """Replace the trainer's progress bar with `MemoryProgress`, or drop bar and log lines under `--quiet` (the run's
    losses are still in log_history.jsonl and the trackers). `shown`: the method's own metrics for the line."""
    bar = trainer.pop_callback(ProgressCallback)  # None in a notebook (its own bar) or with disable_tqdm
    if quiet():
        trainer.pop_callback(PrinterCallback)
    elif bar is not None:
        trainer.add_callback(MemoryProgress(monitor, target, shown))


# -- the done line ---------------------------------------------------------------------------------------------------
def done_line(m: dict, run_dir) -> str:
    """The line `train` ends with: steps, loss, the method's own figures, throughput, where the run is."""
    speed = f", {m['tokens_per_second']:,.0f} tokens/s" if m.get("tokens_per_second") else ""
    return f"done: {m['global_step']} steps, {loss_line(m)}{method_line(m)}{speed}; run directory {run_dir}"


def method_line(m: dict) -> str:
    """A preference run's reward margin and accuracy (chosen over rejected), ORPO's log odds ratio, KTO's KL, at
    its last logged step; a GRPO run's mean reward at its first and last logged steps."""
    got = {k: v for k, v in (m.get("method_metrics") or {}).items() if isinstance(v, int | float)}
    trend = m.get("reward_trend")
    if trend:
        first, last = (f"{v:.4g}" if isinstance(v, int | float) else "none" for v in trend)  # a round unscored: none
        unscored = f", {m['unscored_completions']} completions unscored" if m.get("unscored_completions") else ""
        return f", reward {first} → {last}" + (f", KL {got['kl']:.4g}" if "kl" in got else "") + unscored
    shown = [(name, got[key]) for key, name in (("rewards/margins", "reward margin"),
             ("rewards/accuracies", "accuracy"), ("log_odds_ratio", "log odds ratio"), ("kl", "KL")) if key in got]  # fmt: skip
    return "".join(f", {name} {value:.4g}" for name, value in shown)


def loss_line(m: dict) -> str:
    """The logged training loss at its first and last logged steps — or the one logged step, beside the run's mean
    (`train_loss`), when the run was shorter than training.logging_steps."""
    first, last = m.get("first_loss"), m.get("last_loss")
    if first is None:
        mean = m.get("train_loss")
        return "no loss logged" + (f" (mean {mean:.4f})" if isinstance(mean, int | float) else "")
    at = m.get("first_loss_step"), m.get("last_loss_step")
    if at[0] is None or at[0] != at[1]:
        steps = f" (steps {at[0]} → {at[1]})" if at[0] is not None else ""
        return f"loss {first:.4f} → {last:.4f}{steps}"
    mean = m.get("train_loss")
    return f"loss {first:.4f} at step {at[0]}, the only logged step" + (
        f" (mean over the run {mean:.4f})" if isinstance(mean, int | float) else ""
    )
