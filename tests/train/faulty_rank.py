"""A launched rank that runs out of memory on purpose: `python -m tests.train.faulty_rank train --run-dir DIR`.

tests/train/test_launch.py launches `train --gpus 2` with this module in place of `lowmem_ft` as the ranks' entry
point. It is `lowmem-ft` itself, except that on the rank named by `FAULTY_RANK` the loss of the first micro batch of
optimizer step `FAULTY_STEP` raises an out-of-memory error once, after the loss is computed — so the test can check
that both ranks step down together. No test hook lives in the package.

Why after the loss and not in the forward: TRL 1.16's `SFTTrainer.compute_loss` gathers its token metrics across
ranks (`accelerator.gather_for_metrics`) after every forward, so a rank that fails inside the forward leaves the
others waiting in that gather (a limitation of multi-rank OOM recovery the trainer's docstring states).
"""

from __future__ import annotations

import os
import sys

import torch

from lowmem_ft import cli
from lowmem_ft.train.trainer import MemorySafeSFTTrainer


def main() -> int:
    rank, faulty, step = (
        int(os.environ.get("RANK", "0")),
        int(os.environ["FAULTY_RANK"]),
        int(os.environ["FAULTY_STEP"]),
    )
    compute_loss = MemorySafeSFTTrainer.compute_loss
    pending = [rank == faulty]

    def failing_compute_loss(self, model, inputs, *args, **kwargs):
        result = compute_loss(self, model, inputs, *args, **kwargs)
        if model.training and pending[0] and self.state.global_step + 1 == step:
            pending[0] = False
            raise torch.OutOfMemoryError("CUDA out of memory (injected by tests/train/faulty_rank.py)")
        return result

    MemorySafeSFTTrainer.compute_loss = failing_compute_loss
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
