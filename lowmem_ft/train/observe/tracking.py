"""Trackers for a run (`logging.report_to`: wandb, tensorboard, trackio): which ones, their run config, memory charts.

transformers starts and feeds each tracker (its `report_to` integrations: `WandbCallback`, `TensorBoardCallback`,
`TrackioCallback`); lowmem-ft decides which trackers and W&B's mode (an explicit `WANDB_MODE` wins, then the recipe;
`auto` = online when logged in, offline otherwise), names the run after its run directory and keeps its files
there, checks that each tracker is installed before any data or model work, and adds what transformers does not know:
the resolved recipe and the plan in each tracker's run config (`RunConfig`), and at the end the memory curves as a W&B
line plot against the budget and the predicted peak (`log_memory_charts`). The monitor logs the measured `memory/*`
series per step itself (`lowmem_ft.train.observe.monitor`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from transformers import TrainerCallback

from lowmem_ft.choosing import Choice
from lowmem_ft.console import quiet_stdout
from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import Recipe
from lowmem_ft.rundir import MemoryLog, RunDir

log = logging.getLogger(__name__)
# Environment variables this module sets for a run; a value it set for an earlier run in this process is its own to
# replace (`_setdefault`), one the user set is kept.
_SET_BY_US: dict[str, str] = {}
# W&B online: how long to wait for its server's TCP handshake before falling back to offline, and for wandb.init
# itself (its own default is 90 s, retried; a connection refused took 32 s with 20 s here)
PROBE_TIMEOUT_S = 5.0
INIT_TIMEOUT_S = 30.0
# The memory figure a chart line shows per phase: the peak since the previous sample on CUDA, host RSS without it.
CHART_PHASES = ("forward", "backward", "optimizer", "eval_forward", "eval", "save")


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
    """online / offline / disabled: an explicit WANDB_MODE wins, then the recipe; auto = online when logged in.
    (A WANDB_MODE this module set for an earlier run in this process is not explicit.)"""
    env = os.environ.get("WANDB_MODE")
    if env and env != _SET_BY_US.get("WANDB_MODE"):
        return "disabled" if env in ("disabled", "dryrun_disabled") else env
    mode = recipe.logging.wandb_mode
    if mode != "auto":
        return mode
    return "online" if wandb_logged_in() else "offline"


@dataclass(frozen=True)
class Tracking:
    """The trackers of a run: transformers' `report_to` names, and W&B's mode (disabled when W&B is not one)."""

    mode: str  # online | offline | disabled (W&B)
    trackers: tuple[str, ...] = ("wandb",)

    @property
    def active(self) -> list[str]:
        """The trackers that run (W&B left out when disabled): what transformers' `report_to` gets."""
        return [t for t in self.trackers if t != "wandb" or self.mode != "disabled"]

    @property
    def wandb(self) -> bool:
        return "wandb" in self.active

    @property
    def enabled(self) -> bool:
        """W&B is on (what the monitor logs its per-step memory to)."""
        return self.wandb


def _available(tracker: str) -> bool:
    from transformers.integrations import is_tensorboard_available, is_trackio_available, is_wandb_available

    return {"wandb": is_wandb_available, "tensorboard": is_tensorboard_available, "trackio": is_trackio_available}[
        tracker
    ]()


def _setdefault(key: str, value: str) -> None:
    if os.environ.get(key) in (None, "", _SET_BY_US.get(key)):
        os.environ[key] = _SET_BY_US[key] = value


def configure(recipe: Recipe, run_dir: Path) -> Tracking:
    """The run's trackers (each checked to be installed: one line now, not a crash when the trainer starts) and the
    environment transformers' WandbCallback reads when it starts the run (set before the trainer is built)."""
    trackers = tuple(t for t in recipe.logging.report_to if t != "none")
    tracking = Tracking(wandb_mode(recipe) if "wandb" in trackers else "disabled", trackers)
    with quiet_stdout():  # transformers prints a line when its integrations module is first imported
        missing = [t for t in tracking.active if not _available(t)]
    if missing:
        raise UserError(
            f"logging.report_to {', '.join(missing)}: not installed; `pip install {' '.join(missing)}` or take "
            f"{'it' if len(missing) == 1 else 'them'} out of logging.report_to"
        )
    if tracking.wandb:
        os.environ["WANDB_MODE"] = _SET_BY_US["WANDB_MODE"] = tracking.mode
        _setdefault("WANDB_PROJECT", recipe.logging.wandb_project)
        _setdefault("WANDB_DIR", str(Path(run_dir).resolve()))
        # W&B's quiet setting drops its version header and the ~30-line history and summary it prints when the run
        # finishes (wandb sdk/wandb_run.py `_footer_history_summary_info`); all of it is still logged, and the banner
        # says where the run lives. WANDB_QUIET=false in the environment brings the summary back.
        _setdefault("WANDB_QUIET", "true")
    return tracking


def run_config(recipe: Recipe, choice: Choice) -> dict[str, Any]:
    """What a tracker's run config gets beside the trainer's arguments: the resolved recipe, and the plan (the full
    plan where this process made one, else how the recipe was chosen, as run.json has it)."""
    from lowmem_ft.recipe.load import to_dict

    record = choice.plan_record(recipe)
    plan = {k: v for k, v in record.items() if k != "recipe"} if record else choice.to_dict()
    return {"recipe": to_dict(recipe), "plan": plan}


class RunConfig(TrainerCallback):
    """Puts the resolved recipe and the plan into each tracker's run config, and the plan's memory figures (predicted
    peak, VRAM, budget, margin) into W&B's config and summary beside the `memory/*` series the monitor logs.

    Runs after transformers' tracker callbacks (the trainer's callbacks come first), so their runs exist.
    """

    KEYS = ("predicted_peak_gb", "vram_gb", "budget_gb", "safety_margin_gb")

    def __init__(self, tracking: Tracking, config: dict[str, Any], figures: dict[str, Any], tensorboard=None):
        self.tracking = tracking
        self.config = config
        self.figures = {f"memory/{k}": figures[k] for k in self.KEYS if figures.get(k) is not None}
        self.tensorboard = tensorboard  # transformers' TensorBoardCallback, whose writer gets the text

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.tracking.wandb:
            self._wandb()
        if self.tensorboard is not None and self.tensorboard.tb_writer is not None:
            for key, value in self.config.items():  # markdown: an indented block keeps the layout
                text = json.dumps(value, indent=2, default=str)
                self.tensorboard.tb_writer.add_text(f"lowmem_ft/{key}", "    " + text.replace("\n", "\n    "))
            self.tensorboard.tb_writer.flush()
        if "trackio" in self.tracking.active:
            import trackio

            trackio.config.update(self.config, allow_val_change=True)

    def _wandb(self) -> None:
        import wandb

        run = wandb.run
        if run is None:
            return
        run.config.update({**self.config, **self.figures}, allow_val_change=True)
        for key, value in self.figures.items():
            run.summary[key] = value
        run.define_metric("memory/*", step_metric="train/global_step")


def server_problem(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the W&B server at `url` cannot be reached (a TCP connection to it, within `timeout`), or None. Behind a
    proxy (HTTP(S)_PROXY) a direct connection says nothing: None, and wandb.init finds out itself."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None
    where = urlparse(url)
    port = where.port or (443 if where.scheme == "https" else 80)
    try:
        socket.create_connection((where.hostname or "", port), timeout=timeout).close()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return None


def current_mode(tracking: Tracking) -> str:
    """W&B's mode as the run used it: offline after falling back from an unreachable server (`WandbStart`)."""
    return _SET_BY_US.get("WANDB_MODE", tracking.mode) if tracking.wandb else tracking.mode


class WandbStart(TrainerCallback):
    """Starts the W&B run before transformers' WandbCallback would, which then logs into it (it starts one only when
    there is none): the run's files go to `dir` — wandb reads WANDB_DIR once per process, so a second run in one
    process would otherwise write into the first run's directory — named after the run directory, with the recipe
    and the plan in its config from the first record.

    Online without its server (no network, a firewall, the server down), wandb.init retries for its init_timeout
    (90 s) and raises CommError out of the trainer. Training does not need the tracker: a server found unreachable
    first (`server_problem`, a few seconds at most), or an online start that fails, falls back to offline W&B in the
    run directory, said once; `wandb sync` uploads it later."""

    def __init__(self, tracking: Tracking, name: str, config: dict[str, Any]):
        self.tracking, self.name, self.config = tracking, name, config

    def on_train_begin(self, args, state, control, **kwargs):
        import wandb

        if not state.is_world_process_zero or wandb.run is not None:  # a run the caller started is used as it is
            return
        mode = self.tracking.mode
        if mode == "online":
            url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
            why = server_problem(url)
            if why is not None:
                mode = self._offline(f"cannot reach {url} ({why})")
        try:
            self._init(mode, INIT_TIMEOUT_S if mode == "online" else None)
        except Exception as exc:  # noqa: BLE001 — wandb's errors (CommError, UsageError, AuthenticationError …)
            if mode != "online":
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self._init(self._offline(f"could not start online ({type(exc).__name__}: {first})"), None)

    def _init(self, mode: str, timeout: float | None) -> None:
        import wandb

        settings = wandb.Settings(init_timeout=timeout) if timeout is not None else None
        wandb.init(project=os.environ.get("WANDB_PROJECT"), name=self.name, dir=os.environ.get("WANDB_DIR"),
                   mode=mode, config=self.config, settings=settings)  # fmt: skip

    def _offline(self, why: str) -> str:
        """Switch this process's W&B to offline (transformers' callback reads WANDB_MODE too) and say so, once."""
        os.environ["WANDB_MODE"] = _SET_BY_US["WANDB_MODE"] = "offline"
        where = Path(os.environ.get("WANDB_DIR") or ".") / "wandb"
        log.warning("W&B: %s; logging offline to %s instead — upload it later with `wandb sync %s`", why, where, where)
        return "offline"


def attach(trainer, tracking: Tracking, run: RunDir, config: dict[str, Any], figures: dict[str, Any]) -> None:
    """Bind a built trainer's trackers to the run: W&B starts in the run directory ahead of transformers' callback,
    TensorBoard writes into the run directory, and `RunConfig` follows transformers' own tracker callbacks."""
    from transformers.integrations import TensorBoardCallback

    if tracking.wandb:  # first of all callbacks (the handler's list is transformers' own order of calls)
        trainer.callback_handler.callbacks.insert(0, WandbStart(tracking, run.name, config))
    tensorboard = next((c for c in trainer.callback_handler.callbacks if isinstance(c, TensorBoardCallback)), None)
    if tensorboard is not None and tensorboard.logging_dir is None:  # TENSORBOARD_LOGGING_DIR, if set, wins
        tensorboard.logging_dir = str(run.tensorboard)
    trainer.add_callback(RunConfig(tracking, config, figures, tensorboard))


# -- memory charts -----------------------------------------------------------------------------------------------
def memory_series(log: MemoryLog) -> dict[str, list[tuple[int, float]]]:
    """The memory curves of a run: per phase, (step, GB) at each step — the allocator's peak since the previous
    sample on CUDA (the phase's own peak), host RSS without CUDA — and the plan's budget and predicted peak."""
    cuda = any("peak_gb" in s for s in log.samples)
    key = "peak_gb" if cuda else "rss_gb"
    series: dict[str, dict[int, float]] = {}
    for s in log.samples:
        if key in s and s.get("phase") in CHART_PHASES:
            line = series.setdefault(f"{s['phase']} ({'peak' if cuda else 'host RSS'})", {})
            line[s["step"]] = max(line.get(s["step"], 0.0), s[key])
    out = {name: sorted(points.items()) for name, points in series.items()}
    steps = sorted({step for points in out.values() for step, _ in points})
    for name, field in (("budget", "budget_gb"), ("predicted peak", "predicted_peak_gb")):
        value = log.start.get(field)
        if value is not None and steps:  # without CUDA these are GPU figures beside host memory: the name says so
            out[name if cuda else f"{name} (GPU)"] = [(steps[0], value), (steps[-1], value)]
    return out


def log_memory_charts(run, series: dict[str, list[tuple[int, float]]], key: str = "memory/curves") -> None:
    """The curves as one W&B line plot (a custom chart over a table: it shows in the run's workspace as logged)."""
    import wandb

    if not series:
        return
    names = list(series)
    chart = wandb.plot.line_series(
        xs=[[step for step, _ in series[n]] for n in names],
        ys=[[gb for _, gb in series[n]] for n in names],
        keys=names,
        title="memory by phase (GB) against the budget and the predicted peak",
        xname="optimizer step",
    )
    run.log({key: chart})


def finish(tracking: Tracking, run: RunDir | None = None) -> None:
    """End the W&B run (rank 0's), after logging the run's memory curves from its memory.jsonl."""
    if not tracking.wandb:
        return
    import wandb

    if wandb.run is None:
        return
    if run is not None and run.memory_file().is_file():
        log_memory_charts(wandb.run, memory_series(run.memory_log()))
    wandb.finish()
