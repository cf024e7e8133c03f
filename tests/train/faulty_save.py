"""`lowmem-ft` with time to be killed in: `python -m tests.train.faulty_save train ...`.

tests/train/test_faults.py runs this module in place of `lowmem_ft` so that a SIGKILL or a SIGINT can land where the
test wants it. It is `lowmem-ft` itself, slowed down where the environment says (no test hook lives in the package):

- `SLOW_STEP_S`: sleep this long at the end of every optimizer step, so a kill at a random time lands mid-run;
- `PAUSE_SAVE_AT`: at the save of that step, inside transformers' `_save_checkpoint` — after the weights and the
  optimizer state are written, before the RNG state and trainer_state.json — touch `<PAUSE_MARKER>` and sleep
  `PAUSE_SAVE_S` (default 60 s), so the test can kill the process in the middle of a save.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from transformers import Trainer

from lowmem_ft import cli
from lowmem_ft.train.resilience.trainer import MemorySafeSFTTrainer


def main() -> int:
    slow = float(os.environ.get("SLOW_STEP_S", "0"))
    pause_at = int(os.environ.get("PAUSE_SAVE_AT", "0"))
    marker = os.environ.get("PAUSE_MARKER", "")
    save_rng_state = Trainer._save_rng_state
    training_step = MemorySafeSFTTrainer.training_step

    def paused_save_rng_state(self, output_dir):
        if self.state.global_step == pause_at and marker:
            Path(marker).write_text(output_dir)
            time.sleep(float(os.environ.get("PAUSE_SAVE_S", "60")))
        return save_rng_state(self, output_dir)

    def slow_training_step(self, model, inputs, num_items_in_batch=None):
        if slow and self._window_step != self.state.global_step:  # the first micro batch of each optimizer step
            time.sleep(slow)
        return training_step(self, model, inputs, num_items_in_batch)

    Trainer._save_rng_state = paused_save_rng_state
    MemorySafeSFTTrainer.training_step = slow_training_step
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
