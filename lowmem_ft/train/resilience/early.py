"""The rest of the run's memory shown in its first minute: after step 1, the evaluation's heaviest batch and one save.

Training's heaviest batch runs first (`lowmem_ft.train.resilience.order`); an evaluation that runs out of memory although
training fits, or a save that does (FSDP gathering the full state dict, the optimizer states written out) or finds
the disk full, would otherwise show at the first `eval_steps` or `save_steps` — hours in. So at the end of this
launch's first optimizer step, when the optimizer states exist as they will at every later evaluation and save:

- the eval batch with the most tokens runs one forward as `evaluate` runs it (`MemorySafeSFTTrainer.prove_eval`); an
  OOM steps the eval batch down there, as a real evaluation's would;
- a checkpoint is saved as the run will save it, into `checkpoints/.staging/trial/`, and removed
  (`MemorySafeSFTTrainer.prove_save`); a disk that cannot hold it ends the run in one line, as the first save would.

Each is skipped when the run does it at step 1 anyway (`eval_steps` / `save_steps` of 1) or never (no eval data,
a one-step run). Neither draws from an RNG nor changes a weight: the run's losses are the same with them. What they
cost is measured and said (`log` and `metrics.json` `early_checks`): one eval forward, one checkpoint write.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers import TrainerCallback

log = logging.getLogger(__name__)


class ProveEarly(TrainerCallback):
    """At the end of this launch's first optimizer step, `trainer.prove_eval()` and `trainer.prove_save()` (on all
    ranks together), with what each cost in `self.costs`."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.first_step: int | None = None
        self.costs: dict[str, Any] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_step is None:
            self.first_step = state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.first_step or state.global_step >= state.max_steps:
            return
        evaluating = args.eval_strategy == "steps" and self.trainer.eval_dataset is not None
        if evaluating and state.global_step % int(args.eval_steps) != 0:
            started = time.perf_counter()
            ran = self.trainer.prove_eval()
            if ran is not None:
                self.costs["eval"] = {"samples": ran[0], "tokens": ran[1], "seconds": _since(started)}
        if args.save_strategy == "steps" and state.global_step % int(args.save_steps) != 0:
            started = time.perf_counter()
            self.trainer.prove_save()
            self.costs["save"] = {"seconds": _since(started), "bytes": self.trainer.saver.needed}
        if self.costs:
            log.info("checked at step %d: %s", state.global_step, describe(self.costs))


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)


def describe(costs: dict[str, Any]) -> str:
    parts = []
    if "eval" in costs:
        e = costs["eval"]
        parts.append(f"the evaluation's heaviest batch ({e['samples']} samples, {e['tokens']:,} tokens) ran in "
                     f"{e['seconds']:.2f} s")  # fmt: skip
    if "save" in costs:
        parts.append(f"a trial checkpoint save took {costs['save']['seconds']:.2f} s")
    return "; ".join(parts)
