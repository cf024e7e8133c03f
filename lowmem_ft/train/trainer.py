"""TRL's SFTTrainer with memory monitoring and OOM recovery that loses nothing.

transformers' own answer to an OOM (`auto_find_batch_size`) restarts the loop with a smaller batch, which changes
the effective batch; and an eval OOM shrinks the train batch (transformers #32215). Here the recovery lives inside
`training_step`, below the data loader and the optimizer, so neither notices:

- A micro batch runs as `guard.split` sub-batches (`guard.split_batch`). The loss normalisation is kept: with
  `num_items_in_batch` (transformers 5 counts the loss tokens of the whole accumulated batch in
  `Trainer.get_batch_samples`) each sub-batch's loss is already `sum / N_total`, so sub-batch losses add up to the
  micro batch's; without it, each sub-batch mean is weighted by its share of the micro batch's loss tokens.
- On `torch.OutOfMemoryError` the step's memory is freed, the guard steps down, and the micro batch is redone. If
  any backward had begun since the last optimizer step's gradients were complete, gradients may hold part of the
  failed micro batch: they are zeroed and the optimizer step's earlier micro batches (kept, token ids only) are
  replayed first, so each sample contributes exactly once.
- Batch 1 with checkpointing failing: save a checkpoint of the last completed optimizer step and raise
  `guard.OutOfMemory` (one line, exit 2) with the memory at the failure.
- An OOM in evaluation halves the eval batch and retries the evaluation; the train batch is untouched.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from trl import SFTTrainer

from lowmem_ft.train.guard import OOMGuard, OutOfMemory, free_memory, label_count, split_batch
from lowmem_ft.train.monitor import MemoryMonitor, breakdown

log = logging.getLogger(__name__)


def add_perplexity(logs: dict[str, float]) -> None:
    """Perplexity = exp(mean token cross-entropy), next to every eval loss."""
    if "eval_loss" in logs:
        try:
            logs["eval_perplexity"] = math.exp(logs["eval_loss"])
        except OverflowError:
            logs["eval_perplexity"] = float("inf")


def enable_checkpointing(model) -> None:
    """Activation checkpointing switched on mid-run, with the call `model.prepare_for_training` uses."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if any(not p.requires_grad for p in base.get_input_embeddings().parameters()):
        base.enable_input_require_grads()  # frozen embeddings: checkpointed layers need inputs that require grad
    base.config.use_cache = False


class MemorySafeSFTTrainer(SFTTrainer):
    """`SFTTrainer` + `MemoryMonitor` samples at backward end + OOM recovery (see the module docstring)."""

    def __init__(self, *args, guard: OOMGuard, monitor: MemoryMonitor, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.monitor = monitor
        self._window: list[tuple[dict[str, Any], Any]] = []  # micro batches of the optimizer step in progress
        self._window_step = -1
        self._grads_dirty = False  # a backward began on gradients not yet accounted for by `_window`
        self._loss_weight = 1.0

    # -- training -------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        add_perplexity(logs)  # eval perplexity beside eval loss: W&B, log_history and the best-model metric
        super().log(logs, start_time)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not model.training:
            return result
        self._grads_dirty = True  # the backward of this loss comes next
        if self._loss_weight == 1.0:
            return result
        if return_outputs:
            return result[0] * self._loss_weight, result[1]
        return result * self._loss_weight

    def _run_micro_batch(self, model, inputs, num_items_in_batch) -> torch.Tensor:
        parts = split_batch(inputs, self.guard.sub_batch)
        if len(parts) > 1 and num_items_in_batch is None:
            shifted = getattr(self, "_loss_shifts_labels", True)
            total = max(1, label_count(inputs, shifted))
            weights = [label_count(p, shifted) / total for p in parts]
        else:
            weights = [1.0] * len(parts)
        loss = None
        for part, weight in zip(parts, weights, strict=True):
            self._loss_weight = weight
            try:
                part_loss = super().training_step(model, part, num_items_in_batch)
            finally:
                self._loss_weight = 1.0
            self.monitor.sample("backward")
            loss = part_loss if loss is None else loss + part_loss
        return loss

    def _metric_state(self) -> tuple[int, dict[str, int]]:
        return self._total_train_tokens, {k: len(v) for k, v in self._metrics["train"].items()}

    def _restore_metrics(self, saved: tuple[int, dict[str, int]]) -> None:
        """Forget what failed or replayed passes added to TRL's train metrics (tokens seen, entropy, accuracy)."""
        self._total_train_tokens, lengths = saved
        for key, values in self._metrics["train"].items():
            if isinstance(values, list) and key in lengths and key != "num_tokens":
                del values[lengths[key] :]
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._window_step != self.state.global_step:  # a new optimizer step: its gradients start from zero
            self._window, self._window_step, self._grads_dirty = [], self.state.global_step, False
        replay = False
        while True:
            saved = self._metric_state()
            failure: dict[str, Any] | None = None
            try:
                if replay:
                    model.zero_grad(set_to_none=True)
                    self._grads_dirty = False
                    for past_inputs, past_items in self._window:
                        self._run_micro_batch(model, past_inputs, past_items)
                    self._restore_metrics(saved)  # replayed batches were already counted
                    saved = self._metric_state()
                    replay = False
                loss = self._run_micro_batch(model, inputs, num_items_in_batch)
                break
            except torch.OutOfMemoryError as exc:
                # Read memory while the failed step still holds it; keep no reference to the exception.
                failure = {"error": str(exc).splitlines()[0][:200], **self.monitor.reader()}
            self._restore_metrics(saved)
            replay = replay or self._grads_dirty
            free_memory()
            self._step_down(model, failure)
        self._window.append((inputs, num_items_in_batch))
        self._grads_dirty = False
        return loss

    def _step_down(self, model, failure: dict[str, Any]) -> None:
        before = self.guard.describe()
        action = self.guard.step_down()
        step = self.state.global_step + 1
        if action is None:
            self.monitor.event(
                "oom_fatal",
                f"out of memory at step {step} with micro batch 1 and activation checkpointing",
                level=logging.ERROR,
                before=before,
                memory=failure,
            )
            self._save_checkpoint(self.model_wrapped, trial=None)
            self.monitor.sample("save")
            checkpoint = f"{self.args.output_dir}/checkpoint-{self.state.global_step}"
            raise OutOfMemory(
                f"out of memory at step {step} even with micro batch 1 and activation checkpointing "
                f"({breakdown(failure)}); saved {checkpoint} (the last completed step); lower memory.max_seq_len, "
                "use a smaller model or a plan for a smaller --vram, then continue with --resume"
            )
        if action.startswith("activation checkpointing"):
            enable_checkpointing(model)
        self.monitor.event(
            "oom_recovered",
            f"out of memory at step {step}: {action}; redoing the step",
            before=before,
            after=self.guard.describe(),
            action=action,
            memory=failure,
        )

    # -- evaluation -----------------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        while True:
            failure: dict[str, Any] | None = None
            try:
                return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            except torch.OutOfMemoryError as exc:
                failure = {"error": str(exc).splitlines()[0][:200], **self.monitor.reader()}
            self._metrics["eval"].clear()
            free_memory()
            batch = self.args.per_device_eval_batch_size
            if batch <= 1:
                self.monitor.event(
                    "eval_skipped",
                    f"out of memory in evaluation at eval batch 1; skipping this evaluation ({breakdown(failure)})",
                    memory=failure,
                )
                return {}
            # Only the eval batch shrinks: training goes on with its own batch (transformers #32215).
            self.args.per_device_eval_batch_size = self.guard.eval_batch = (batch + 1) // 2
            self.monitor.event(
                "eval_oom_recovered",
                f"out of memory in evaluation: eval batch {batch} → {self.args.per_device_eval_batch_size}; "
                "train batch unchanged",
                eval_batch_before=batch,
                eval_batch_after=self.args.per_device_eval_batch_size,
                memory=failure,
            )
