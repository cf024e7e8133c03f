"""The whole run's training loss and time, across resumes: what `metrics.json` reports as `train_loss`.

The one idea: transformers' `train_loss` is the mean over the steps of one `train()` call (`_finalize_training`:
the loss summed since this call began, over `global_step - _initial_global_step`), so after a `--resume` it covers
only the resumed steps. The loss of the steps before is not in the log history either when logging_steps does not
divide the step a checkpoint was saved at. So each checkpoint keeps the running sum (transformers' `ExportableState`,
`TrainerState.stateful_callbacks` in trainer_state.json, as the guard keeps its step-down), and the resumed call adds
its own.

Under `train --gpus` the loss of steps not yet logged is this rank's until the next logging step gathers it; the
sum saved is rank 0's view of it (the same as the gathered mean with logging_steps 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState


@dataclass(frozen=True)
class Totals:
    """The steps whose loss is known, their loss summed, and the seconds spent training them."""

    steps: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0

    def __add__(self, other: Totals) -> Totals:
        return Totals(self.steps + other.steps, self.loss_sum + other.loss_sum, self.seconds + other.seconds)

    @property
    def mean_loss(self) -> float | None:
        return self.loss_sum / self.steps if self.steps else None


class RunTotals(TrainerCallback, ExportableState):
    """Keeps `Totals` of the steps before this `train()` call (from the resumed checkpoint) and saves the running
    totals in every checkpoint. `bind` it to the trainer, whose loss accumulators it reads at a save."""

    def __init__(self):
        self.before = Totals()
        self.trainer = None
        self._began = time.monotonic()

    def bind(self, trainer) -> None:
        self.trainer = trainer

    def _this_call(self) -> Totals:
        """This call's steps and loss so far, read where transformers keeps them (trainer.py `_finalize_training`)."""
        t = self.trainer
        steps = t.state.global_step - getattr(t, "_initial_global_step", 0)
        loss = getattr(t, "_total_loss_scalar", 0.0) + float(getattr(t, "_tr_loss", 0.0))
        return Totals(steps, loss, time.monotonic() - self._began)

    def state(self) -> dict[str, Any]:
        now = self.before + self._this_call() if self.trainer is not None else self.before
        return {"args": {}, "attributes": {"steps": now.steps, "loss_sum": now.loss_sum, "seconds": now.seconds}}

    def on_train_begin(self, args, state, control, **kwargs):
        """Take the totals a resumed checkpoint saved; a checkpoint from before them counts its logged losses."""
        self._began = time.monotonic()
        name = type(self).__name__
        saved = state.stateful_callbacks.get(name)
        saved = saved[-1] if isinstance(saved, list) else saved
        if isinstance(saved, dict) and isinstance(saved.get("attributes"), dict):
            a = saved["attributes"]
            self.before = Totals(int(a.get("steps", 0)), float(a.get("loss_sum", 0.0)), float(a.get("seconds", 0.0)))
        elif state.global_step > 0:
            self.before = logged_totals(state.log_history)
        state.stateful_callbacks.setdefault(name, self.state())

    def whole_run(self, output_metrics: dict[str, Any]) -> Totals:
        """The whole run's totals at the end of `train()`, from the call's own `train_loss` and `train_runtime`."""
        t = self.trainer
        steps = t.state.global_step - getattr(t, "_initial_global_step", 0)
        mean = output_metrics.get("train_loss")
        loss = mean * steps if isinstance(mean, int | float) else 0.0
        return self.before + Totals(steps, loss, float(output_metrics.get("train_runtime", 0.0)))


def logged_totals(history: list[dict[str, Any]]) -> Totals:
    """Totals from logged losses alone: each `loss` row is the mean since the row before it."""
    steps, loss, last = 0, 0.0, 0
    for row in history:
        if "loss" in row and "step" in row and row["step"] > last:
            span = row["step"] - last
            steps, loss, last = steps + span, loss + row["loss"] * span, row["step"]
    return Totals(steps, loss)


def final_metrics(trainer, output_metrics: dict[str, Any], history: list[dict[str, Any]], totals: RunTotals):
    """The common final metrics of a run, across resumes: the mean training loss and time (`totals`), the trainer's
    rates of the last call, first/last loss, and with eval data the best evaluation and what was kept."""
    from pathlib import Path

    logged = [h for h in history if "loss" in h]
    # transformers' train_loss and train_runtime cover this call only: after --resume, the resumed steps
    whole = totals.whole_run(output_metrics)
    metrics = {
        **output_metrics,
        "train_loss": whole.mean_loss,
        "train_loss_steps": whole.steps,
        "train_runtime": round(whole.seconds, 4),
        "global_step": trainer.state.global_step,
        "first_loss": logged[0]["loss"] if logged else None,
        "last_loss": logged[-1]["loss"] if logged else None,
        "first_loss_step": logged[0].get("step") if logged else None,
        "last_loss_step": logged[-1].get("step") if logged else None,
    }
    evals = [h for h in history if "eval_loss" in h]
    if evals:
        best = min(evals, key=lambda h: h["eval_loss"])
        # what load_best_model_at_end loaded, hence what finalize saved to adapter/ (or model/)
        best_dir = trainer.state.best_model_checkpoint
        metrics |= {
            "last_eval_loss": evals[-1]["eval_loss"],
            "last_eval_perplexity": evals[-1]["eval_perplexity"],
            "best_eval_loss": best["eval_loss"],
            "best_eval_perplexity": best["eval_perplexity"],
            "best_step": best["step"],
            "best_checkpoint": best_dir,
            "saved_weights": f"best checkpoint ({Path(best_dir).name})" if best_dir else "last step",
        }
    return metrics
