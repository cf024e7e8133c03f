"""Stopping on SIGINT / SIGTERM / SIGHUP without losing a step: finish the optimizer step in progress, save, stop.

The one idea: a signal only raises a flag; the trainer acts on it at the end of the optimizer step in progress
(`on_step_end` sets `control.should_save` and `control.should_training_stop`), where a checkpoint is exact, so
`--resume` continues as if nothing had happened. The run then ends as `interrupted` (run.json), with exit code 130
(SIGINT), 143 (SIGTERM) or 129 (SIGHUP: a closed terminal or SSH session) and one line saying how to resume (`lowmem_ft.errors.Interrupted`, raised by
`lowmem_ft.train.run`). A second Ctrl-C aborts at
once: the steps since the last checkpoint are lost, and a save it cuts short is never taken for whole
(`lowmem_ft.train.resilience.checkpoints`). Before training starts (data, model) there is nothing to save and a signal stops at
once; after training ended (final save) a first signal is noted and the run finishes.

transformers' own `enable_jit_checkpoint` (trainer_jit_checkpoint.py) answers SIGTERM only, after a fixed 3 s
wait, saves from `on_pre_optimizer_step` and leaves the exit and the run's record to the caller; hence this module.

Several processes (`train --gpus N`): the launching `train` passes SIGINT/SIGTERM to accelerate, which runs in a
session of its own, and torchrun forwards them to the ranks, but not necessarily within the same step. At each step
end the ranks agree (one all-reduce of a flag), so all stop after the same step and save one checkpoint together.
A rank started by hand in a terminal's process group may get a Ctrl-C twice in a few milliseconds (from the
terminal and from torchrun): a second SIGINT aborts only `REPEAT_S` or more after the first. torchrun kills ranks still running 30 s after it forwarded a signal (its agent's `shutdown_timeout`): a
step and a save longer than that are cut short, and the run resumes from the checkpoint before.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from typing import Literal

from transformers import TrainerCallback

from lowmem_ft.errors import Interrupted
from lowmem_ft.train.distributed.ranks import largest

log = logging.getLogger(__name__)

# SIGHUP: the terminal or SSH session the run was started from closed (the kernel hangs up its process group); by
# default it kills the process at once, so it is answered as SIGTERM is: a checkpoint, `interrupted`, exit 129.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
REPEAT_S = 1.0  # a second SIGINT sooner than this is the same Ctrl-C delivered twice (terminal + torchrun)


class StopOnSignal(TrainerCallback):
    """The signal handlers of a run (`install` / `uninstall`, main thread only) and the callback that stops the
    trainer after the step in progress. `received` is this process's first signal; `stopped_by` the signal the
    ranks agreed to stop on (another rank's, when this one got none) and `stopped_at` the step they stopped after."""

    def __init__(self):
        self.received: int | None = None
        self.stopped_by: int | None = None
        self.stopped_at: int | None = None
        self.phase: Literal["setup", "training", "finishing"] = "setup"
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        signum = self.stopped_by or self.received
        return signal.Signals(signum).name if signum is not None else ""

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # Python runs handlers in the main thread only
            return
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self._first_at = signum, time.monotonic()
            if self.phase == "setup":
                raise Interrupted(f"interrupted by {name} before training started", signum)
            what = (
                "finishing the step in progress, then saving a checkpoint and stopping"
                if self.phase == "training"
                else "finishing the final save"
            )
            with contextlib.suppress(OSError):  # SIGHUP: the terminal is gone and writing fails; the run still stops
                print(f"lowmem-ft: {name}: {what} (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
            return
        if signum == signal.SIGINT and time.monotonic() - self._first_at >= REPEAT_S:
            self.uninstall()
            raise KeyboardInterrupt  # the run records it (lowmem_ft.train.run) and the CLI exits 130

    # -- TrainerCallback ------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self.phase = "training"

    def on_step_end(self, args, state, control, **kwargs):
        asked = self.received if self.received is not None and self.phase == "training" else 0
        # every rank, every step: stop after the same step on all of them (the last step finishes anyway)
        signum = largest(asked, args.device)
        if signum and state.global_step < state.max_steps:
            self.stopped_by, self.stopped_at = signum, state.global_step
            control.should_save = True
            control.should_training_stop = True
            log.info("%s: stopping after step %d", self.name, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.phase = "finishing"
