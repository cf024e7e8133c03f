"""TRL's SFTTrainer with memory monitoring and OOM recovery that loses nothing.

transformers' own answer to an OOM (`auto_find_batch_size`) restarts the loop with a smaller batch, which changes
the effective batch; and an eval OOM shrinks the train batch (transformers #32215). Here the recovery lives inside
`training_step`, below the data loader and the optimizer, so neither notices. This module is the mechanism; what to
do next is the guard's decision (`lowmem_ft.train.resilience.guard.MemoryGuard`):

- A micro batch runs as the pieces `guard.pieces` cuts (rows, or samples of a packed row). The loss normalisation
  is kept: with `num_items_in_batch` (transformers 5 counts the loss tokens of the whole accumulated batch in
  `Trainer.get_batch_samples`) each piece's loss is already `sum / N_total`, so the pieces' losses add up to the
  micro batch's; without it, each piece's mean is weighted by its share of the micro batch's loss tokens.
- On `torch.OutOfMemoryError` the step's memory is freed, the guard steps down, and the micro batch is redone. If
  any backward had begun since the last optimizer step's gradients were complete, gradients may hold part of the
  failed micro batch: they are zeroed and the optimizer step's earlier micro batches (kept, token ids only) are
  replayed first, so each sample contributes exactly once.
- When the guard has nothing left: save a checkpoint of the last completed optimizer step and raise
  `guard.OutOfMemory` (one line, exit 2) with the memory at the failure.
- A retry repeats the failed attempt's randomness: each micro batch draws one seed for its LoRA dropout masks
  (`lowmem_ft.train.resilience.dropout`: the same masks whether the micro batch runs whole or in pieces), and the global RNG
  state (CPU and this process's CUDA device, what `torch.utils.checkpoint` restores for a recomputation) taken at
  the micro batch's start is restored before the retry and before each replayed micro batch. So a recovered step
  equals the uninterrupted one, LoRA dropout included.
- An OOM in evaluation lowers the eval batch (the guard's) and retries the evaluation; the train batch is untouched.
- Checkpoints are saved whole or not at all (`lowmem_ft.train.resilience.checkpoints`): transformers' `_save_checkpoint` runs
  unchanged with the staging directory as its output directory, and the result is renamed when complete.
- Each epoch's order is seeded with (data seed, epoch) and starts with its heaviest micro batch
  (`lowmem_ft.train.resilience.order.HeaviestFirstSampler`): the same order whether the epoch is reached by training or by
  `--resume`, and an OOM in the first minute rather than at the step the longest sample arrives.
- Several processes (`train --gpus N`): after each micro batch attempt the ranks all-reduce which of them ran out
  of memory (one small collective), so every rank steps down and redoes the same micro batch together. Under DDP
  each attempt runs in `no_sync` and the gradients are averaged by one flat all-reduce once the optimizer step's
  last micro batch succeeded everywhere: a rank that fails mid-backward would otherwise leave the others waiting in
  DDP's bucket all-reduce. FSDP / ZeRO gather weights inside forward and backward, so there an OOM is agreed on
  only when it leaves every rank's collectives complete (not the case for an OOM between two all-gathers). Nor, under
  any strategy, for an OOM inside the forward: TRL 1.16's `compute_loss` gathers its token metrics across ranks
  (`accelerator.gather_for_metrics`) right after the forward, and the ranks that did not fail wait there. OOMs in
  the backward or after the loss are agreed on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from torch import distributed as dist
from torch.utils.data import RandomSampler
from transformers.trainer_pt_utils import LengthGroupedSampler
from trl import SFTTrainer

from lowmem_ft.data.profile import lengths_of
from lowmem_ft.rundir import RunDir
from lowmem_ft.train.device import free_memory
from lowmem_ft.train.distributed.ranks import barrier, world_size
from lowmem_ft.train.observe.monitor import MemoryMonitor
from lowmem_ft.train.resilience import dropout
from lowmem_ft.train.resilience.checkpoints import Saver
from lowmem_ft.train.resilience.guard import MemoryGuard
from lowmem_ft.train.resilience.order import HeaviestFirstSampler, batch_tokens
from lowmem_ft.train.resilience.split import label_count, piece_spans

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Draw:
    """The randomness of one micro batch: its LoRA dropout seed and the global RNG state right after drawing it."""

    seed: int
    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def take(cls) -> Draw:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        # this process's device only: the one whose generator its kernels draw from (torch.utils.checkpoint saves
        # the input tensors' devices likewise)
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(seed, torch.random.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


def add_perplexity(logs: dict[str, float]) -> None:
    """Perplexity = exp(mean token cross-entropy), next to every eval loss."""
    if "eval_loss" in logs:
        try:
            logs["eval_perplexity"] = math.exp(logs["eval_loss"])
        except OverflowError:
            logs["eval_perplexity"] = float("inf")


class MemorySafe:
    """`MemoryMonitor` samples at backward end + OOM recovery (see the module docstring), for a TRL trainer:
    `MemorySafeSFTTrainer` here, the preference trainers in `lowmem_ft.train.methods.preference`."""

    def __init__(
        self, *args, guard: MemoryGuard, monitor: MemoryMonitor, run: RunDir, loraplus_lr_ratio: float = 0, **kwargs
    ):
        self.loraplus_lr_ratio = loraplus_lr_ratio
        super().__init__(*args, **kwargs)
        self.guard = guard
        # a collator whose batches hold more than rows (image chats' pixel values per image) says how to cut them
        guard.split_rows = getattr(self.data_collator, "split", None) or guard.split_rows
        self.monitor = monitor
        self.saver = Saver(run)
        self.dropout = dropout.install(self.model)
        self._staging: bool | str = False  # in `_save_checkpoint`: True (a checkpoint) or "trial" (`prove_save`)
        self._window: list[tuple[dict[str, Any], Any, Draw]] = []  # micro batches of the optimizer step in progress
        self._window_step = -1
        self._grads_dirty = False  # a backward began on gradients not yet accounted for by `_window`
        self._loss_weight = 1.0

    def create_optimizer(self, model=None):
        """With `optimizer.loraplus_lr_ratio`, peft's LoRA+ optimizer: the Trainer's optimizer class and arguments,
        with lora_B's learning rate × the ratio (peft/optimizers/loraplus.py); else the Trainer's own."""
        if not self.loraplus_lr_ratio or self.optimizer is not None:
            return super().create_optimizer(model)
        from peft.optimizers import create_loraplus_optimizer

        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        self.optimizer = create_loraplus_optimizer(
            self.model if model is None else model,
            cls,
            loraplus_lr_ratio=self.loraplus_lr_ratio,
            weight_decay=self.args.weight_decay,
            **kwargs,
        )
        return self.optimizer

    def create_model_card(self, *args, **kwargs) -> None:
        """No TRL draft card in checkpoints/ at every save: lowmem-ft writes the run's own model card with the saved
        weights (`lowmem_ft.hub.write_card`), and TRL's draft asks W&B for a run URL, which an offline run answers
        with a console warning at every checkpoint."""

    # -- training -------------------------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        """transformers' order (length-grouped or random), seeded per epoch, the heaviest micro batch first
        (`lowmem_ft.train.resilience.order`): an OOM or a wrong plan shows in step 1, and --resume continues exactly."""
        sampler = super()._get_train_sampler(train_dataset)
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        grouped = type(sampler) is LengthGroupedSampler and sampler.generator is None
        if not (grouped or type(sampler) is RandomSampler) or not hasattr(dataset, "data"):
            return sampler  # a stream (no sampler), or an order someone chose on purpose
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        lengths = sampler.lengths if grouped else lengths_of(dataset)
        return HeaviestFirstSampler(
            lengths,
            self.args.per_device_train_batch_size,
            seed,
            group_size=sampler.batch_size if grouped else 0,
            padded=not self.padding_free,
        )

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

    def _pieces(self, inputs, num_items_in_batch) -> tuple[list[dict[str, Any]], list[float], tuple]:
        """The pieces the guard cuts, each piece's share of the micro batch's loss, and where they lie in it
        (`split.piece_spans`)."""
        parts = self.guard.pieces(inputs)
        if len(parts) > 1 and num_items_in_batch is None:
            shifted = getattr(self, "_loss_shifts_labels", True)
            total = max(1, label_count(inputs, shifted))
            weights = [label_count(p, shifted) / total for p in parts]
        else:
            weights = [1.0] * len(parts)
        return parts, weights, piece_spans(inputs, parts)

    def _run_micro_batch(self, model, inputs, num_items_in_batch, draw: Draw) -> torch.Tensor:
        parts, weights, (dim, full, spans) = self._pieces(inputs, num_items_in_batch)
        loss = None
        for part, weight, (start, size) in zip(parts, weights, spans, strict=True):
            self._loss_weight = weight
            try:
                with self.dropout.piece(dropout.Piece(draw.seed, dim, full, start, size)):
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

    def _oom_ranks(self, failed: bool) -> list[int]:
        """Ranks that ran out of memory in this attempt, agreed by all (one all-reduce of a world-sized flag)."""
        flags = torch.zeros(world_size(), dtype=torch.int32, device=self.args.device)
        flags[self.monitor.rank] = int(failed)
        dist.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def _average_gradients(self, model) -> None:
        """DDP's gradient average, done once per optimizer step after every rank's micro batches succeeded."""
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= world_size()
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(synced)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._window_step != self.state.global_step:  # a new optimizer step: its gradients start from zero
            self._window, self._window_step, self._grads_dirty = [], self.state.global_step, False
        several = world_size() > 1
        ddp = several and isinstance(model, torch.nn.parallel.DistributedDataParallel)
        replay, draw, attempts = False, Draw.take(), 0
        while True:
            saved = self._metric_state()
            failure: dict[str, Any] | None = None
            try:
                with model.no_sync() if ddp else contextlib.nullcontext():
                    loss = self._attempt(model, inputs, num_items_in_batch, draw, replay, attempts, saved)
                    replay = False
            except torch.OutOfMemoryError as exc:
                # Read memory while the failed step still holds it; keep no reference to the exception.
                failure = {"error": str(exc).splitlines()[0][:200], **self.monitor.reader()}
            if several:
                ranks = self._oom_ranks(failure is not None)
                if ranks and failure is None:  # this rank succeeded, another did not: redo it together
                    failure = {"error": f"out of memory on rank {', '.join(map(str, ranks))}", **self.monitor.reader()}
                if failure is not None:
                    failure["ranks"] = ranks
            if failure is None:
                break
            self._restore_metrics(saved)
            replay = replay or self._grads_dirty
            attempts += 1
            free_memory()
            self._step_down(model, failure)
        if ddp and self.accelerator.sync_gradients:
            self._average_gradients(model)
        self._window.append((inputs, num_items_in_batch, draw))
        self._grads_dirty = False
        return loss

    def _attempt(self, model, inputs, num_items_in_batch, draw: Draw, replay: bool, attempts: int, saved):
        """One try at the micro batch, with the randomness of the first (`draw`); replay the optimizer step's
        earlier micro batches first if asked, each with its own."""
        if replay:
            model.zero_grad(set_to_none=True)
            self._grads_dirty = False
            for past_inputs, past_items, past_draw in self._window:
                past_draw.restore()
                self._run_micro_batch(model, past_inputs, past_items, past_draw)
            self._restore_metrics(saved)  # replayed batches were already counted
        if replay or attempts:
            draw.restore()
        return self._run_micro_batch(model, inputs, num_items_in_batch, draw)

    def _step_down(self, model, failure: dict[str, Any]) -> None:
        """The guard's next step down; when it has none, save the last completed step and stop in one line."""
        step = self.state.global_step + 1
        if self.guard.recover(step, failure):
            return
        self._save_checkpoint(self.model_wrapped, trial=None)
        self.monitor.sample("save")
        raise self.guard.out_of_memory(step, failure, f"{self.args.output_dir}/checkpoint-{self.state.global_step}")

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        # transformers composes the checkpoint's path from this in `_save_checkpoint`: during a save, the staging one
        # (a trial save, `prove_save`: a directory of its own inside it)
        if self._staging:
            return str(self.saver.run.staging / "trial" if self._staging == "trial" else self.saver.run.staging)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' save, into `checkpoints/.staging/checkpoint-N`, renamed to `checkpoint-N` when every rank
        has written its part; the disk's room checked first (`lowmem_ft.train.resilience.checkpoints`)."""
        step = self.state.global_step
        self.saver.check_space(self, step)
        self._staging = True
        try:
            super()._save_checkpoint(model, trial)
        except Exception as exc:
            failure = self.saver.failed(exc, step)
            if failure is exc:
                raise
            raise failure from None
        finally:
            self._staging = False
        self.saver.publish(self, step)

    def prove_save(self) -> None:
        """Save a checkpoint as the run will (transformers' `_save_checkpoint`, its disk check first) into
        `checkpoints/.staging/trial/` and remove it: the save's memory and the disk's room shown at step 1. A save
        that cannot happen ends the run there, as it would at the first real save (call on all ranks)."""
        step = self.state.global_step
        trial = self.saver.run.staging / "trial"
        self.saver.check_space(self, step)
        self._staging = "trial"
        try:
            super()._save_checkpoint(self.model_wrapped, trial=None)
        except Exception as exc:
            shutil.rmtree(trial, ignore_errors=True)
            failure = self.saver.failed(exc, step)
            if failure is exc:
                raise
            raise failure from None
        finally:
            self._staging = False
        self.monitor.sample("save")
        barrier()
        if self.args.should_save:
            shutil.rmtree(trial, ignore_errors=True)
            with contextlib.suppress(OSError):  # the staging directory, empty now
                self.saver.run.staging.rmdir()

    # -- evaluation -----------------------------------------------------------------------------------------------
    def prove_eval(self) -> tuple[int, int] | None:
        """Run the evaluation's heaviest batch (by tokens, in the order evaluation reads: as stored) through one
        forward as `evaluate` runs it, stepping the eval batch down on OOM as `evaluate` would. Returns (samples,
        tokens) of the batch that ran, or None when there is no evaluation or nothing fits."""
        dataset = self.eval_dataset
        if dataset is None or not hasattr(dataset, "data"):
            return None
        lengths = lengths_of(dataset)
        padded = not self.padding_free
        while True:
            size = self.guard.eval_batch
            batches = [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
            batch = max(batches, key=lambda b: batch_tokens(b, lengths, padded))
            inputs = self._prepare_inputs(self.data_collator([dataset[i] for i in batch]))
            self.model.eval()  # as evaluate runs it (no dropout); the next training step sets train mode again
            try:
                self.prediction_step(self.model, inputs, prediction_loss_only=True)
                return len(batch), batch_tokens(batch, lengths, padded)
            except torch.OutOfMemoryError as exc:
                failure = {"error": str(exc).splitlines()[0][:200], **self.monitor.reader()}
            finally:
                self._metrics["eval"].clear()  # TRL's eval metrics of this forward are not an evaluation's
                self.model.train()
            del inputs
            free_memory()
            if not self.guard.recover_eval(failure):
                return None

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        while True:
            self.args.per_device_eval_batch_size = self.guard.eval_batch
            try:
                return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            except torch.OutOfMemoryError as exc:
                failure = {"error": str(exc).splitlines()[0][:200], **self.monitor.reader()}
            self._metrics["eval"].clear()
            free_memory()
            if not self.guard.recover_eval(failure):
                return {}


class MemorySafeSFTTrainer(MemorySafe, SFTTrainer):
    """`SFTTrainer` with the memory monitor's samples and OOM recovery of `MemorySafe`."""
