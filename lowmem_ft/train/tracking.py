"""Weights & Biases for a run: which mode, the environment transformers' `WandbCallback` reads, the run's config.

transformers starts and feeds the W&B run (`report_to=["wandb"]`); lowmem-ft decides the mode (an explicit
`WANDB_MODE` wins, then the recipe; `auto` = online when logged in, offline otherwise), points the run at the run
directory, and adds the plan's memory figures to the run's config and summary (`PlanConfig`). The monitor logs the
measured `memory/*` series itself (`lowmem_ft.train.monitor`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from lowmem_ft.recipe.schema import Recipe


def wandb_logged_in() -> bool:
    """An API key in WANDB_API_KEY or in ~/.netrc for the W&B host (where `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        # wandb's own netrc reader; `wandb.api.api_key` reads the same but is deprecated (and warns) in wandb 0.2x
        from wandb.sdk.lib.wbauth import read_netrc_auth

        return bool(read_netrc_auth(host=os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")))
    except Exception:  # wandb unavailable, moved, or a malformed netrc: no usable login
        return False


def wandb_mode(recipe: Recipe) -> str:
    """online / offline / disabled: an explicit WANDB_MODE wins, then the recipe; auto = online when logged in."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return "disabled" if env in ("disabled", "dryrun_disabled") else env
    mode = recipe.logging.wandb_mode
    if mode != "auto":
        return mode
    return "online" if wandb_logged_in() else "offline"


@dataclass(frozen=True)
class Tracking:
    mode: str  # online | offline | disabled

    @property
    def report_to(self) -> list[str]:
        return [] if self.mode == "disabled" else ["wandb"]

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


def configure(recipe: Recipe, run_dir: Path) -> Tracking:
    """The run's W&B mode, and the environment transformers' WandbCallback reads (set before it starts)."""
    tracking = Tracking(wandb_mode(recipe))
    if tracking.enabled:
        os.environ["WANDB_MODE"] = tracking.mode
        os.environ.setdefault("WANDB_PROJECT", recipe.logging.wandb_project)
        os.environ.setdefault("WANDB_DIR", str(Path(run_dir).resolve()))
    return tracking


def finish(tracking: Tracking) -> None:
    if not tracking.enabled:
        return
    import wandb

    if wandb.run is not None:
        wandb.finish()


class PlanConfig(TrainerCallback):
    """Puts the plan's figures (predicted peak, VRAM, budget, margin) into the W&B run's config and summary, beside
    the `memory/*` series the monitor logs."""

    KEYS = ("predicted_peak_gb", "vram_gb", "budget_gb", "safety_margin_gb")

    def __init__(self, figures: dict[str, Any]):
        self.figures = {f"memory/{k}": figures[k] for k in self.KEYS if figures.get(k) is not None}

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        try:
            import wandb
        except ImportError:
            return
        run = wandb.run
        if run is None:
            return
        run.config.update(self.figures, allow_val_change=True)
        for key, value in self.figures.items():
            run.summary[key] = value
        run.define_metric("memory/*", step_metric="train/global_step")
