"""A launched rank with a fault on purpose: `python -m tests.train.faulty_rank train --run-dir DIR`.

tests/train/distributed/test_launch.py and tests/train/test_launch_faults.py launch `train --gpus 2` with this module in place
of `lowmem_ft` as the ranks' entry point. It is `lowmem-ft` itself, except that on the rank named by `FAULTY_RANK`,
in the first micro batch of optimizer step `FAULTY_STEP`, after the loss is computed, `FAULT` happens once:

- `oom` (the default): an out-of-memory error, so the test can check that both ranks step down together;
- `error`: a ValueError, as a bad sample in that rank's shard would raise;
- `kill`: the process kills itself with SIGKILL (what kill -9 or the host's OOM killer does);
- `hang`: the process sleeps for `HANG_S` seconds (default 600), as a rank stuck in a driver call or a dead NFS read.
  SIGTERM ends the sleep (its default action, which the run's own interrupt handler had replaced): the launch stops
  the hung rank with SIGTERM once the others have failed, and torchrun then waits 30 s before its SIGKILL for a rank
  that outlives the SIGTERM (`PContext.close`) — torchrun's wait, not lowmem-ft's, so the drill does not sit it out.

No test hook lives in the package. Why after the loss and not in the forward: TRL 1.16's `SFTTrainer.compute_loss`
gathers its token metrics across ranks (`accelerator.gather_for_metrics`) after every forward, so a rank that fails
inside the forward leaves the others waiting in that gather (a limitation of multi-rank OOM recovery the trainer's
docstring states).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from lowmem_ft import cli
from lowmem_ft.train.resilience.trainer import MemorySafeSFTTrainer


def fault(kind: str, rank: int) -> None:
    if kind == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory (injected by tests/train/faulty_rank.py)")
    if kind == "error":
        raise ValueError(f"a bad sample in rank {rank}'s shard (injected by tests/train/faulty_rank.py)")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(float(os.environ.get("HANG_S", "600")))


def main() -> int:
    rank, faulty, step = (
        int(os.environ.get("RANK", "0")),
        int(os.environ["FAULTY_RANK"]),
        int(os.environ["FAULTY_STEP"]),
    )
    kind = os.environ.get("FAULT", "oom")
    compute_loss = MemorySafeSFTTrainer.compute_loss
    pending = [rank == faulty]

    def failing_compute_loss(self, model, inputs, *args, **kwargs):
        result = compute_loss(self, model, inputs, *args, **kwargs)
        if model.training and pending[0] and self.state.global_step + 1 == step:
            pending[0] = False
            fault(kind, rank)
        return result

    MemorySafeSFTTrainer.compute_loss = failing_compute_loss
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
