"""The eval scores sent to the trackers the training run used (its recipe's `logging.report_to`).

- W&B: the training run's own W&B run is resumed (its id read from the run directory's `wandb/` folder, where the
  training run kept its files) in the mode training used (`tracking.wandb_mode`: offline stays offline, and
  `wandb sync` uploads it later), and the scores go into its summary as `eval/<task>/<metric>` (and
  `eval_base/…`, `eval_delta/…` with --compare-base) — the run's page shows them beside its training curves.
  Without a W&B folder (the run logged elsewhere) a new run of the same name is started in the run directory.
- TensorBoard: the same scalars in the run's `tensorboard/` folder at the run's last optimizer step.
- trackio: the same keys logged once to a run of the run's name.
Trackers are best effort here: the scores are in eval.json whatever happens, so a tracker that cannot start is said
in one warning, not an error.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def flat(tuned: dict, base: dict | None, delta: dict | None) -> dict[str, float]:
    """`eval/<task>/<metric>` (and `eval_base/`, `eval_delta/`) → value."""
    out = {}
    for prefix, table in (("eval", tuned), ("eval_base", base), ("eval_delta", delta)):
        for task, row in (table or {}).items():
            for metric, value in row.items():
                out[f"{prefix}/{task}/{metric}"] = value
    return out


def wandb_run_id(run_dir: Path) -> str | None:
    """The id of the W&B run training kept in `run_dir/wandb` (its folders are `[offline-]run-<time>-<id>`)."""
    folders = sorted((run_dir / "wandb").glob("*run-*-*"), key=lambda p: p.stat().st_mtime)
    folders = [p for p in folders if p.is_dir() and not p.is_symlink()]
    return folders[-1].name.rpartition("-")[2] if folders else None


def last_step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "metrics.json").read_text()).get("global_step") or 0)
    except (OSError, ValueError, AttributeError):
        return 0


def send(recipe, run_dir: Path, scores: dict[str, float]) -> list[str]:
    """Log `scores` to each tracker of `recipe`; returns the trackers that got them."""
    from lowmem_ft.train.observe.tracking import wandb_mode

    trackers = [t for t in recipe.logging.report_to if t != "none"]
    sent = []
    for tracker in trackers:
        try:
            if tracker == "wandb":
                mode = wandb_mode(recipe)
                if mode == "disabled":
                    continue
                _wandb(recipe, run_dir, scores, mode)
            elif tracker == "tensorboard":
                _tensorboard(run_dir / "tensorboard", scores, last_step(run_dir))
            elif tracker == "trackio":
                _trackio(recipe, run_dir, scores)
            else:
                continue
        except Exception as exc:  # noqa: BLE001 — a tracker's own errors; eval.json holds the scores regardless
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("eval: the scores did not reach %s (%s); they are in eval.json", tracker, first)
            continue
        sent.append(tracker)
    return sent


def _wandb(recipe, run_dir: Path, scores: dict[str, float], mode: str) -> None:
    import wandb

    run_id = wandb_run_id(run_dir)
    run = wandb.init(project=recipe.logging.wandb_project, name=run_dir.name, dir=str(run_dir), mode=mode,
                     id=run_id, resume="allow" if run_id else None, reinit="finish_previous")  # fmt: skip
    try:
        for key, value in scores.items():
            run.summary[key] = value
        run.log(scores)
    finally:
        run.finish()


def _tensorboard(folder: Path, scores: dict[str, float], step: int) -> None:
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
    except ImportError:
        from tensorboardX import SummaryWriter  # what transformers' TensorBoardCallback falls back to too

    os.makedirs(folder, exist_ok=True)
    writer = SummaryWriter(log_dir=str(folder))
    try:
        for key, value in scores.items():
            writer.add_scalar(key, value, global_step=step)
    finally:
        writer.close()


def _trackio(recipe, run_dir: Path, scores: dict[str, float]) -> None:
    import trackio

    trackio.init(project=recipe.logging.wandb_project, name=run_dir.name)
    trackio.log(scores)
    trackio.finish()
