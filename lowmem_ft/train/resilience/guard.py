"""The memory policy of a run: what to do when memory runs short — in training, in evaluation, and before it runs out.

The one idea: an out-of-memory error is answered by running the *same* micro batch in smaller pieces, never by
changing what the optimizer sees. The data loader keeps yielding micro batches of the configured size in the same
order; the trainer (`lowmem_ft.train.resilience.trainer`) runs each as the pieces `MemoryGuard.pieces` cuts
(`lowmem_ft.train.resilience.split`: rows of a padded batch, samples of a packed row) and accumulates their gradients with
the loss normalisation unchanged. Each step down halves the piece — "halve the micro batch, double gradient
accumulation" with the effective batch and sample order exactly preserved. When a piece cannot be cut further,
activation checkpointing is switched on (by the guard, on the model); when that still fails, the run stops with a
checkpoint (`OutOfMemory`). Evaluation steps down its own batch only. The same step-down is taken before an OOM
when measured memory keeps falling into the safety margin (`watch`, fed every sample by the monitor).

The guard decides and the monitor (`lowmem_ft.train.observe.monitor`) observes and records: the guard reads samples and
writes events through it, never the other way round. The guard's state (how far it stepped down) is saved in every
checkpoint through transformers' `ExportableState` (`TrainerState.stateful_callbacks` in trainer_state.json) and
read back in place at `on_train_begin`, so `--resume` continues at the step-down the run had reached.
transformers' own restore (`restore_callback_states_from_checkpoint=True`, Trainer._load_callback_state) is not
used: it rebuilds the callback from its saved constructor arguments and swaps the instance, which would cut the
guard off from the trainer, the monitor and the model it acts on.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from lowmem_ft.errors import UserError
from lowmem_ft.memory.target import Target
from lowmem_ft.train.observe.monitor import MemoryMonitor, breakdown, growth, used_gb
from lowmem_ft.train.resilience.split import sample_starts, samples_in, split_packed, split_rows

log = logging.getLogger(__name__)


class OutOfMemory(UserError):
    """Out of memory with the smallest pieces and activation checkpointing: nothing left to step down."""


def enable_checkpointing(model) -> None:
    """Activation checkpointing switched on mid-run, with the call `model.prepare_for_training` uses."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if any(not p.requires_grad for p in base.get_input_embeddings().parameters()):
        base.enable_input_require_grads()  # frozen embeddings: checkpointed layers need inputs that require grad
        from lowmem_ft.vision.tower import freeze_tower_inputs

        freeze_tower_inputs(base)  # ... but not a vision tower's (lowmem_ft.vision.tower)
    base.config.use_cache = False


class MemoryGuard(TrainerCallback, ExportableState):
    """The step-down state of a run and the policy that moves it.

    `micro_batch`, `gradient_accumulation` and `checkpointing` are the configured values (the effective batch
    `micro_batch × gradient_accumulation` never changes); `halvings` is how many times the pieces were halved,
    `checkpointing` whether activation checkpointing is on now, `eval_batch` the evaluation batch. `recorder` (the
    run's `MemoryMonitor`) receives the events; `target` is the memory the run must fit (None: no margin policy).
    """

    def __init__(
        self,
        micro_batch: int,
        gradient_accumulation: int,
        checkpointing: bool,
        eval_batch: int = 0,
        *,
        recorder: MemoryMonitor | None = None,
        target: Target | None = None,
    ):
        self.micro_batch = micro_batch
        self.gradient_accumulation = gradient_accumulation
        self.configured_checkpointing = checkpointing
        self.configured_eval_batch = eval_batch or micro_batch
        self.halvings = 0
        self.checkpointing = checkpointing
        self.eval_batch = self.configured_eval_batch
        self.recorder = recorder
        self.target = target
        self.model = None
        # cuts a padded micro batch into pieces of at most n rows; the trainer sets its collator's own where the
        # batch holds inputs that are not one row per sample (`lowmem_ft.vision.data.VisionCollator.split`)
        self.split_rows = split_rows
        self._packed = False  # the last micro batch was a packed row
        self._packed_finer = True  # ... and a piece of it held more than one sample
        self._first: dict[str, dict[str, Any]] = {}  # first sample of each phase: the baseline "what grew" compares to
        self._margin_seen_at: float | None = None  # headroom when the margin warning was given

    # -- state -------------------------------------------------------------------------------------------------------
    @property
    def sub_batch(self) -> int:
        """Rows per forward of a padded batch: ⌈micro_batch / 2^halvings⌉ (the same as halving, rounding up, again)."""
        return math.ceil(self.micro_batch / 2**self.halvings)

    @property
    def split(self) -> int:
        """Pieces per micro batch (at most, for packed rows: a row has only so many samples)."""
        return 2**self.halvings if self._packed else math.ceil(self.micro_batch / self.sub_batch)

    @property
    def effective_accumulation(self) -> int:
        return self.gradient_accumulation * self.split

    def describe(self) -> dict[str, Any]:
        return {
            "micro_batch": self.sub_batch,
            "pieces": self.split,
            "gradient_accumulation": self.effective_accumulation,
            "effective_batch": self.micro_batch * self.gradient_accumulation,
            "gradient_checkpointing": self.checkpointing,
        }

    def state(self) -> dict[str, Any]:
        """What each checkpoint keeps (transformers' `ExportableState`): the configuration and how far it stepped."""
        return {
            "args": {
                "micro_batch": self.micro_batch,
                "gradient_accumulation": self.gradient_accumulation,
                "checkpointing": self.configured_checkpointing,
                "eval_batch": self.configured_eval_batch,
            },
            "attributes": {
                "halvings": self.halvings,
                "checkpointing": self.checkpointing,
                "eval_batch": self.eval_batch,
            },
        }

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Bind the model, and continue from the step-down a resumed checkpoint saved (the same configuration only)."""
        self.model = model
        name = type(self).__name__
        saved = state.stateful_callbacks.get(name)
        saved = saved[-1] if isinstance(saved, list) else saved
        if isinstance(saved, dict) and saved.get("args") == self.state()["args"]:
            for key, value in saved.get("attributes", {}).items():
                setattr(self, key, value)
        state.stateful_callbacks.setdefault(name, self.state())  # a checkpoint from before the guard saved state
        if self.checkpointing and not self.configured_checkpointing and model is not None:
            enable_checkpointing(model)
        if (self.halvings, self.checkpointing) != (0, self.configured_checkpointing):
            log.info("resuming with the step-down the run had reached after an OOM: %s", self.describe())
        args.per_device_eval_batch_size = self.eval_batch
        self._tag()

    def _tag(self) -> None:
        if self.recorder is not None:
            self.recorder.tag(micro_batch=self.sub_batch, pieces=self.split)

    # -- training ------------------------------------------------------------------------------------------------
    def pieces(self, inputs: dict[str, Any]) -> list[dict[str, Any]]:
        """The micro batch as the pieces the current step-down runs, in order."""
        packed = sample_starts(inputs)
        self._packed = packed is not None and len(packed) > 1
        if self._packed:
            parts = split_packed(inputs, 2**self.halvings)
            self._packed_finer = any(samples_in(p) > 1 for p in parts)
            return parts
        return self.split_rows(inputs, self.sub_batch)

    def _can_cut(self) -> bool:
        """Whether halving the pieces still cuts something: rows left to part, or a piece of several samples."""
        return self._packed_finer if self._packed else self.sub_batch > 1

    def _step_down(self) -> str | None:
        """Take the next step down; returns what was done, or None when nothing is left."""
        before = self.describe()
        if self._can_cut():
            self.halvings += 1
            after = self.describe()
            self._tag()
            what = (
                f"packed micro batch cut at sample boundaries into {before['pieces']} → {after['pieces']} pieces"
                if self._packed
                else f"micro batch {before['micro_batch']} → {after['micro_batch']}"
            )
            return (
                f"{what}, gradient accumulation {before['gradient_accumulation']} → {after['gradient_accumulation']} "
                f"(effective batch {after['effective_batch']} unchanged)"
            )
        if not self.checkpointing:
            self.checkpointing = True
            if self.model is not None:
                enable_checkpointing(self.model)
            why = "a piece holds one sample, which cannot be cut" if self._packed else "micro batch already 1"
            return f"activation checkpointing switched on ({why})"
        return None

    def recover(self, step: int, failure: dict[str, Any]) -> bool:
        """After an OOM in a training step: step down and record it; False (recorded too) when nothing is left."""
        before = self.describe()
        action = self._step_down()
        if action is None:
            self._event(
                "oom_fatal",
                f"out of memory at step {step} with the smallest pieces and activation checkpointing",
                level=logging.ERROR,
                before=before,
                memory=failure,
            )
            return False
        self._event(
            "oom_recovered",
            f"out of memory at step {step}: {action}; redoing the step",
            before=before,
            after=self.describe(),
            action=action,
            memory=failure,
        )
        return True

    def out_of_memory(self, step: int, failure: dict[str, Any], checkpoint: str) -> OutOfMemory:
        """The one-line error of a run that cannot step down further (after `recover` returned False)."""
        return OutOfMemory(
            f"out of memory at step {step} even with micro batch 1 and activation checkpointing "
            f"({breakdown(failure)}); saved {checkpoint} (the last completed step); lower memory.max_seq_len, "
            "use a smaller model or a plan for a smaller --vram, then continue with --resume"
        )

    def outside_step(self, step: int, exc: BaseException, figures: dict[str, Any]) -> OutOfMemory:
        """An OOM outside the forward/backward pass (optimizer step, checkpoint save), where no smaller piece helps:
        recorded, and the one-line error."""
        self._event("oom_fatal", f"out of memory outside a training step: {exc}", level=logging.ERROR, memory=figures)
        return OutOfMemory(
            f"out of memory at step {step} outside the forward/backward pass, where a smaller batch does not help "
            f"({breakdown(figures)}); lower memory use of the optimizer (optimizer.name paged_adamw_8bit) or the "
            "model, then continue from the last checkpoint with --resume"
        )

    # -- evaluation ------------------------------------------------------------------------------------------------
    def recover_eval(self, failure: dict[str, Any]) -> bool:
        """After an OOM in evaluation: halve the eval batch only (training keeps its own, transformers #32215); False
        (recorded) when it is 1 already and this evaluation is skipped."""
        batch = self.eval_batch
        if batch <= 1:
            self._event(
                "eval_skipped",
                f"out of memory in evaluation at eval batch 1; skipping this evaluation ({breakdown(failure)})",
                memory=failure,
            )
            return False
        self.eval_batch = (batch + 1) // 2
        self._event(
            "eval_oom_recovered",
            f"out of memory in evaluation: eval batch {batch} → {self.eval_batch}; train batch unchanged",
            eval_batch_before=batch,
            eval_batch_after=self.eval_batch,
            memory=failure,
        )
        return True

    # -- the safety margin -----------------------------------------------------------------------------------------
    def watch(self, sample: dict[str, Any]) -> None:
        """Every memory sample: warn once when memory in use crosses the budget into the safety margin (naming what
        grew), and when it keeps falling past half the margin, step down before an OOM comes."""
        used = used_gb(sample)
        first = self._first.setdefault(sample["phase"], sample)
        if used is None or self.target is None:
            return
        t = self.target
        headroom = t.budget_gb - used  # below zero: inside the margin
        if headroom >= 0:
            return
        if self._margin_seen_at is None:
            what, grew = growth(sample, first)
            self._margin_seen_at = headroom
            self._event(
                "margin",
                f"memory in use {used:.2f} GB is over the {t.budget_gb:g} GB budget (VRAM {t.vram_gb:g} − safety "
                f"margin {t.margin_gb:g}{f' − {t.calibration_gb:g} calibrated' if t.calibration_gb else ''}) at step "
                f"{sample['step']} ({sample['phase']}); {what} grew {grew:+.2f} GB "
                f"since step {first['step']}",
                headroom_gb=round(headroom, 4),
                grew=what,
                grew_gb=round(grew, 4),
            )
            return
        # Still falling after the warning, and past half the margin: the next spike is an OOM. Step down now (same
        # effective batch and sample order as an OOM recovery, without losing the step).
        if headroom < min(self._margin_seen_at, -t.margin_gb / 2):
            self._margin_seen_at = headroom
            action = self._step_down()
            if action is not None:
                self._event(
                    "margin_action",
                    f"memory still rising ({used:.2f} GB in use, {-headroom:.2f} GB into the safety margin): "
                    f"{action} before an out-of-memory error",
                    headroom_gb=round(headroom, 4),
                    action=action,
                    **self.describe(),
                )

    def _event(self, kind: str, message: str, level: int = logging.WARNING, **info: Any) -> None:
        if self.recorder is None:
            log.log(level, message)
            return
        self.recorder.event(kind, message, level=level, **info)
