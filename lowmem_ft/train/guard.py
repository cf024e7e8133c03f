"""Keeping a run inside its memory: allocator set-up, the `--vram` cap, and the step-down policy after an OOM.

The one idea: an out-of-memory error is answered by running the *same* micro batch in smaller pieces, never by
changing what the optimizer sees. The data loader keeps yielding micro batches of the configured size in the same
order; the trainer (`lowmem_ft.train.trainer`) splits each into `split` sub-batches of at most `sub_batch` rows
and accumulates their gradients with the loss normalisation unchanged. Halving `sub_batch` is therefore "halve the
micro batch, double gradient accumulation" with the effective batch and sample order exactly preserved. When rows
cannot be split further, activation checkpointing is switched on; when batch 1 with checkpointing still fails, the
run stops with a checkpoint (`OutOfMemory`).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError

log = logging.getLogger(__name__)

GB = 1e9  # decimal, like lowmem_ft.memory.estimate.GB and --vram
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# Expandable segments let the caching allocator grow a segment in place instead of leaving differently sized
# blocks stranded between steps of varying sequence length (torch docs, "Optimizing memory usage with
# PYTORCH_CUDA_ALLOC_CONF"); it is read when the allocator initialises, so it must be set before CUDA is first used.
DEFAULT_ALLOC_CONF = "expandable_segments:True"


class OutOfMemory(UserError):
    """Out of memory at micro batch 1 with activation checkpointing: nothing left to step down."""


def configure_allocator() -> str | None:
    """Set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` unless the user set it; returns what is in effect."""
    import torch

    if ALLOC_CONF in os.environ:
        return os.environ[ALLOC_CONF]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning("CUDA was initialised before lowmem-ft could set %s=%s", ALLOC_CONF, DEFAULT_ALLOC_CONF)
        return None
    os.environ[ALLOC_CONF] = DEFAULT_ALLOC_CONF
    return DEFAULT_ALLOC_CONF


def cap_process_memory(vram_gb: float | None, device: int | None = None) -> float | None:
    """Cap this process's CUDA allocator at `vram_gb` GB when the card is bigger; returns the budget in GB.

    `torch.cuda.set_per_process_memory_fraction` makes the caching allocator raise OutOfMemoryError once reserved
    memory would pass the fraction — the same error a card of that size would give, so a 24 GB plan is honoured (and
    tested) on an 80 GB card. Without `vram_gb` the budget is the whole card; without CUDA there is none (None).
    """
    import torch

    if not torch.cuda.is_available():
        return vram_gb
    device = torch.cuda.current_device() if device is None else device
    total = torch.cuda.get_device_properties(device).total_memory
    if vram_gb is None:
        return total / GB
    if vram_gb * GB < total:
        torch.cuda.set_per_process_memory_fraction(vram_gb * GB / total, device)
        log.info("capped CUDA memory of this process at %.1f of the card's %.1f GB (--vram)", vram_gb, total / GB)
        return vram_gb
    return total / GB


def free_memory() -> None:
    """Return the failed step's memory: drop Python references (the traceback is gone by now) and cached blocks."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class OOMGuard:
    """The step-down state of a run: rows per forward (`sub_batch`) and whether checkpointing is on.

    `micro_batch` and `gradient_accumulation` are the configured values; they never change, so the effective batch
    is `micro_batch × gradient_accumulation` throughout.
    """

    micro_batch: int
    gradient_accumulation: int
    checkpointing: bool
    sub_batch: int = 0
    eval_batch: int = 0

    def __post_init__(self):
        self.sub_batch = self.sub_batch or self.micro_batch
        self.eval_batch = self.eval_batch or self.micro_batch

    @property
    def split(self) -> int:
        """Sub-batches per micro batch."""
        return math.ceil(self.micro_batch / self.sub_batch)

    @property
    def effective_accumulation(self) -> int:
        return self.gradient_accumulation * self.split

    def describe(self) -> dict[str, Any]:
        return {
            "micro_batch": self.sub_batch,
            "gradient_accumulation": self.effective_accumulation,
            "effective_batch": self.micro_batch * self.gradient_accumulation,
            "gradient_checkpointing": self.checkpointing,
        }

    def step_down(self) -> str | None:
        """Take the next step down; returns what was done, or None when at batch 1 with checkpointing."""
        if self.sub_batch > 1:
            before = self.describe()
            self.sub_batch = math.ceil(self.sub_batch / 2)
            after = self.describe()
            return (
                f"micro batch {before['micro_batch']} → {after['micro_batch']}, gradient accumulation "
                f"{before['gradient_accumulation']} → {after['gradient_accumulation']} "
                f"(effective batch {after['effective_batch']} unchanged)"
            )
        if not self.checkpointing:
            self.checkpointing = True
            return "activation checkpointing switched on (micro batch already 1)"
        return None


def restore_step_down(guard: OOMGuard, run_dir: Path) -> dict[str, Any] | None:
    """On `--resume`, continue with the step-down the run had reached (its last `oom_recovered` event in
    memory.jsonl), so a resumed run does not hit the same OOM again. Returns the restored state, or None."""
    path = Path(run_dir) / "memory.jsonl"
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the crash that ended the run
            continue
        if record.get("event") == "oom_recovered" and isinstance(record.get("after"), dict):
            last = record["after"]
    if last is None:
        return None
    guard.sub_batch = min(guard.micro_batch, int(last.get("micro_batch", guard.sub_batch)))
    guard.checkpointing = guard.checkpointing or bool(last.get("gradient_checkpointing"))
    return guard.describe()


def split_batch(inputs: dict[str, Any], rows: int) -> list[dict[str, Any]]:
    """Split a collated batch into consecutive sub-batches of at most `rows` rows, in order.

    Every tensor whose first dimension is the batch size is sliced; anything else (scalars, flags) is shared.
    Padded length is kept, so each row is computed exactly as in the whole batch.
    """
    import torch

    batch = inputs["input_ids" if "input_ids" in inputs else "labels"].shape[0]
    if rows >= batch:  # also every padding-free / packed batch: one row, with per-sequence tensors beside it
        return [inputs]
    sizes = {v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if sizes != {batch}:
        raise ValueError(f"cannot split a batch whose tensors disagree on the batch size: {sorted(sizes)}")
    return [
        {k: v[start : start + rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in inputs.items()}
        for start in range(0, batch, rows)
    ]


def label_count(inputs: dict[str, Any], shifted: bool) -> int:
    """Tokens that carry loss in a batch, counted like `Trainer._get_num_items_in_batch` (transformers trainer.py):
    `shift_labels` if the collator made them, else `labels[..., 1:]` for causal LM losses, else `labels`."""
    if "shift_labels" in inputs:
        labels = inputs["shift_labels"]
    else:
        labels = inputs["labels"][..., 1:] if shifted else inputs["labels"]
    return int(labels.ne(-100).sum())


def out_of_memory_outside_step(trainer, exc: BaseException) -> OutOfMemory:
    """The user-facing error for an OOM the guard cannot step down from (optimizer step, checkpoint save)."""
    from lowmem_ft.train.monitor import breakdown

    figures = trainer.monitor.reader()
    trainer.monitor.event("oom_fatal", f"out of memory outside a training step: {exc}", memory=figures)
    return OutOfMemory(
        f"out of memory at step {trainer.state.global_step + 1} outside the forward/backward pass, where a smaller "
        f"batch does not help ({breakdown(figures)}); lower memory use of the optimizer (optimizer.name "
        f"paged_adamw_8bit) or the model, then continue from the last checkpoint with --resume"
    )
