"""LoRA dropout whose masks do not depend on how a micro batch is cut, so a recovered OOM step is exact.

torch's dropout draws its mask from the global generator in the shape of the call. Run a micro batch of 4 rows as
two pieces of 2 (an OOM step-down, `lowmem_ft.train.resilience.guard`) and the masks differ from the whole batch's even with
the generator's state restored: 3e-2 in the adapter weights of the tiny test run after one step-down under the
shipped LoRA dropout 0.05 (measured with tests/train/tiny_runs.py: the whole run vs one OOM at step 2, with and
without restoring the RNG state for the retry). No library offers dropout that is invariant to batch splitting,
hence this module:

- The trainer draws one seed per micro batch from the global generator and runs each piece inside
  `DropoutContext.piece(Piece(seed, dim, full, start, size))` — where the piece lies in the micro batch.
- `StableDropout` takes the place of peft's `nn.Dropout` in every `lora_dropout`. It seeds its own generator from
  the micro batch's seed and the module's index, draws the keep-mask in the shape of the *whole* micro batch, and
  keeps the piece's rows (padded batch) or tokens (packed row). Unsplit, that is one draw in the input's own shape,
  saving a 1-byte bool mask for backward as torch's CUDA dropout does (`memory/estimate.py` DROPOUT_MASK_BYTES; on
  the CPU torch's dropout keeps a 4-byte noise tensor, this one 1 byte). Split into k pieces, each piece draws the
  whole micro batch's mask again: k× the random numbers, and for one module at a time a transient bool tensor of
  the whole micro batch's input to it. Measured on the CPU (benchmarks/robust_cpu.md, LoRA branch alone, base
  linear left out): +8 % unsplit, 1.6× at 2 pieces, 2.6× at 4.
- Recomputation under activation checkpointing draws the same mask (same seed, same piece). Outside a micro batch
  of the trainer (another trainer, a test calling the model) it is torch's dropout.

Inputs whose `dim` does not follow the micro batch (tokens regrouped per expert in MoE layers) get a mask of their
own shape from the same seeded generator: repeatable — a retry at the same step-down is exact — but not
split-stable. A module called twice in one forward (shared layers) draws the same mask both times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / φ: spreads module indices over the seed space (SplitMix64's increment)


@dataclass(frozen=True)
class Piece:
    """Where a piece lies in its micro batch: cut along `dim` (0: rows of a padded batch, 1: tokens of a packed
    row), the micro batch's size `full` along it, the piece's `start` and `size`; `seed` is the micro batch's."""

    seed: int
    dim: int
    full: int
    start: int
    size: int


class DropoutContext:
    """The piece being run (None outside the trainer's micro batches) and one generator per device."""

    def __init__(self):
        self.current: Piece | None = None
        self._generators: dict[torch.device, torch.Generator] = {}

    @contextlib.contextmanager
    def piece(self, piece: Piece) -> Iterator[None]:
        previous, self.current = self.current, piece
        try:
            yield
        finally:
            self.current = previous

    def keep_mask(self, x: torch.Tensor, index: int, keep: float) -> torch.Tensor:
        """The keep-mask (bool, the shape of `x`) of module `index` for the current piece."""
        piece = self.current
        generator = self._generators.get(x.device)
        if generator is None:
            generator = self._generators[x.device] = torch.Generator(device=x.device)
        generator.manual_seed((piece.seed + (index + 1) * GOLDEN) % 2**64)
        d = piece.dim
        follows = x.dim() > d and x.shape[d] == piece.size
        if not follows or piece.size == piece.full:
            return torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(keep, generator=generator)
        shape = list(x.shape)
        shape[d] = piece.full
        whole = torch.empty(shape, dtype=torch.bool, device=x.device).bernoulli_(keep, generator=generator)
        return whole.narrow(d, piece.start, piece.size).clone()  # the clone lets the whole mask go


class StableDropout(nn.Module):
    """Dropout with probability `p` whose mask depends on the micro batch, not on the piece (module docstring)."""

    def __init__(self, p: float, index: int, context: DropoutContext):
        super().__init__()
        self.p, self.index, self.context = p, index, context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.context.current is None:
            return F.dropout(x, self.p, training=True)
        keep = self.context.keep_mask(x, self.index, 1.0 - self.p)
        return (x * keep).mul_(1.0 / (1.0 - self.p))  # autograd keeps the bool mask only, as torch's dropout does

    def extra_repr(self) -> str:
        return f"p={self.p}, split-stable #{self.index}"


def install(model: nn.Module) -> DropoutContext:
    """Put `StableDropout` in place of every `nn.Dropout` (p > 0) of peft's `lora_dropout` dicts, numbered in module
    order (the same model gives the same numbers in every process); returns the context the trainer drives."""
    context = DropoutContext()
    index = 0
    for module in list(model.modules()):
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, nn.ModuleDict):
            continue
        for name, dropout in list(dropouts.items()):
            if type(dropout) is nn.Dropout and dropout.p > 0:
                dropouts[name] = StableDropout(dropout.p, index, context)
                index += 1
    return context
