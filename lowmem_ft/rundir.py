"""A run directory, `<training.output_dir>/<name>/`: the one owner of every file a run writes and reads.

The run directory is the contract between `train` and every later command (`report`, `generate`, `merge`,
`train --resume`, the ranks of `train --gpus`). `RunDir` knows each file's name and format; every other module asks
it for a path or a record, and nobody else composes `run_dir / "x.json"`:

| file | written by | what |
| --- | --- | --- |
| recipe.yaml | train / launch | the fully resolved recipe (`train --recipe runs/NAME/recipe.yaml` reproduces the run) |
| run.json | train (rank 0) | model, data summary, how the recipe was chosen (`Choice`), versions, parameter counts |
| plan.json | train (rank 0) | with --vram: the full plan (components, reasons, strategy) |
| data_report.json | train (rank 0) | what the token budget did to the samples, and the batching |
| memory.jsonl | the monitor | memory samples and events; `memory.rank{R}.jsonl` for rank R > 0 |
| memory.png | report | the memory curve |
| metrics.json, log_history.jsonl | train (rank 0) | final metrics and every logged row |
| checkpoints/ | the trainer | resumable checkpoints (`checkpoint-N`) |
| adapter/ or model/ | train | the trained LoRA adapter (+ tokenizer), or the full model |
| accelerate.yaml, launch.json | train --gpus | how the ranks were launched |

One meaning per field: `budget_gb` is VRAM − safety margin in plan.json, run.json and memory.jsonl alike.
`memory.jsonl` has one reader, `memory_log`, which tolerates a last line cut short by a crash.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowmem_ft.errors import UserError

if TYPE_CHECKING:
    from lowmem_ft.planning import Choice
    from lowmem_ft.recipe.schema import Recipe


def check_run_name(name: str) -> str:
    """A run name is a name: one path component, so the run stays inside `<training.output_dir>/`."""
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    if not name or name in (".", "..") or any(s in name for s in separators) or "\0" in name:
        raise UserError(
            f"--name {name!r}: a run name is a name, not a path (no '/', '\\', '..'); the run goes to "
            "<training.output_dir>/<name> — set training.output_dir to choose where"
        )
    return name


def default_run_name(model: str) -> str:
    base = Path(model.rstrip("/")).name or "model"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"


@dataclass
class MemoryLog:
    """The records of a memory file: the start record (the latest, for a resumed run), samples and events.

    `start["budget_gb"]` is VRAM − margin; files written before that meaning (a `budget_gb` without `vram_gb`, when
    the field held the VRAM itself) are read in the current meaning. `unreadable` counts lines that are not JSON —
    the last line of a run that crashed while writing it.

    Predictions, one meaning each: `start["predicted_peak_gb"]` is the plan's peak on CUDA (overheads included; None
    without a plan); on the CPU, `start["predicted_cpu_peak_gb"]` and `start["predicted_cpu_phases_gb"]` are the
    memory model's CPU form (live tensor bytes) for the plan's batch `start["predicted_cpu_batch"]` ([rows,
    tokens]), and `start["exact"]` says the samples count live tensors exactly. A CPU sample's `live_gb` is live
    tensor bytes at the sample, `peak_live_gb` their exact peak since the previous sample, and
    `predicted_peak_live_gb` the memory model's prediction of that peak for the sample's phase and `batch` (the
    rows × tokens that ran); phases without one (save, eval) have none.
    """

    start: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    unreadable: int = 0


def _start_record(record: dict[str, Any]) -> dict[str, Any]:
    if "vram_gb" not in record and record.get("budget_gb") is not None:  # the old meaning: budget_gb was the VRAM
        margin = record.get("safety_margin_gb") or 0.0
        record = {**record, "vram_gb": record["budget_gb"], "budget_gb": record["budget_gb"] - margin}
    return record


class RunDir:
    """The files of one run directory (see the module docstring); `path` is the directory."""

    RECIPE = "recipe.yaml"
    INFO = "run.json"
    PLAN = "plan.json"
    DATA_REPORT = "data_report.json"
    METRICS = "metrics.json"
    LOG_HISTORY = "log_history.jsonl"
    MEMORY_PLOT = "memory.png"
    CHECKPOINTS = "checkpoints"
    ACCELERATE = "accelerate.yaml"
    LAUNCH = "launch.json"

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    # -- where runs are ---------------------------------------------------------------------------------------------
    @classmethod
    def new(cls, output_dir: str | Path, name: str | None, model: str) -> RunDir:
        """A fresh run directory `<output_dir>/<name>` (default name: model-timestamp), created empty."""
        run = cls(Path(output_dir) / check_run_name(name or default_run_name(model)))
        if run.path.exists() and any(run.path.iterdir()):
            raise UserError(
                f"run directory {run.path} already exists; pick another --name or continue it with --resume {run.path}"
            )
        run.path.mkdir(parents=True, exist_ok=True)
        return run

    @classmethod
    def existing(cls, path: str | Path) -> RunDir:
        """A run directory written by `train` (it has recipe.yaml), or a UserError saying it is not one."""
        run = cls(path)
        if not run.path.is_dir():
            raise UserError(f"run directory {path} does not exist; pass runs/<name> of a `lowmem-ft train` run")
        if not run.recipe_file.is_file():
            raise UserError(f"{path}: not a run directory (no {cls.RECIPE}); pass runs/<name>")
        return run

    # -- paths ------------------------------------------------------------------------------------------------------
    @property
    def recipe_file(self) -> Path:
        return self.path / self.RECIPE

    @property
    def info_file(self) -> Path:
        return self.path / self.INFO

    @property
    def plan_file(self) -> Path:
        return self.path / self.PLAN

    @property
    def data_report_file(self) -> Path:
        return self.path / self.DATA_REPORT

    @property
    def metrics_file(self) -> Path:
        return self.path / self.METRICS

    @property
    def log_history_file(self) -> Path:
        return self.path / self.LOG_HISTORY

    @property
    def memory_plot(self) -> Path:
        return self.path / self.MEMORY_PLOT

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def accelerate_file(self) -> Path:
        return self.path / self.ACCELERATE

    @property
    def launch_file(self) -> Path:
        return self.path / self.LAUNCH

    def memory_file(self, rank: int = 0) -> Path:
        """memory.jsonl for rank 0 (and a single process), memory.rank{R}.jsonl for the others."""
        return self.path / ("memory.jsonl" if rank == 0 else f"memory.rank{rank}.jsonl")

    def weights(self, full: bool) -> Path:
        """adapter/ (LoRA adapter + tokenizer), or model/ for a full fine-tune."""
        return self.path / ("model" if full else "adapter")

    # -- records ----------------------------------------------------------------------------------------------------
    def _write_json(self, path: Path, data: Any) -> None:
        path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")

    def _read_json(self, path: Path) -> dict[str, Any] | None:
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            return None

    def write_recipe(self, recipe: Recipe) -> None:
        from lowmem_ft.recipe.load import dump

        self.recipe_file.write_text(dump(recipe, header=f"resolved recipe of run {self.name}"), encoding="utf-8")

    def read_recipe(self, overrides: list[str] | dict | None = None) -> Recipe:
        """The resolved recipe the run was trained with, plus any new `--set` overrides."""
        from lowmem_ft.recipe.load import resolve

        if not self.recipe_file.is_file():
            raise UserError(f"{self.path}: not a run directory (no {self.RECIPE}); pass runs/<name>")
        return resolve(self.recipe_file, overrides)

    def write_info(self, info: dict[str, Any]) -> None:
        self._write_json(self.info_file, info)

    def read_info(self) -> dict[str, Any]:
        return self._read_json(self.info_file) or {}

    def read_choice(self) -> Choice | None:
        """How the run's recipe was chosen (run.json), or None when the run never wrote it."""
        from lowmem_ft.planning import Choice

        record = self.read_info().get("choice")
        return Choice.from_dict(record) if isinstance(record, dict) else None

    def write_plan(self, record: dict[str, Any]) -> None:
        self._write_json(self.plan_file, record)

    def read_plan(self) -> dict[str, Any] | None:
        """plan.json (with --vram: the plan the run trained with), or None."""
        return self._read_json(self.plan_file)

    def read_metrics(self) -> dict[str, Any] | None:
        """metrics.json of a finished run, or None."""
        return self._read_json(self.metrics_file)

    def write_data_report(self, report: dict[str, Any]) -> None:
        self._write_json(self.data_report_file, report)

    def write_metrics(self, metrics: dict[str, Any], history: list[dict[str, Any]]) -> None:
        self._write_json(self.metrics_file, metrics)
        with self.log_history_file.open("w", encoding="utf-8") as handle:
            for row in history:
                handle.write(json.dumps(row) + "\n")

    def write_launch(self, accelerate_config: str, info: dict[str, Any]) -> None:
        self.accelerate_file.write_text(accelerate_config, encoding="utf-8")
        self._write_json(self.launch_file, info)

    def read_launch(self) -> dict[str, Any]:
        info = self._read_json(self.launch_file)
        if not self.recipe_file.is_file() or info is None:
            raise UserError(
                f"--run-dir {self.path}: not a prepared run (needs {self.RECIPE} and {self.LAUNCH} from --gpus)"
            )
        return info

    def last_checkpoint(self) -> Path | None:
        """The checkpoint to resume from (transformers' `get_last_checkpoint`), or None."""
        if not self.checkpoints.is_dir():
            return None
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(str(self.checkpoints))
        return Path(last) if last else None

    def memory_log(self, rank: int = 0) -> MemoryLog:
        """The records of a memory file, tolerating a last line cut short by a crash (see `MemoryLog`)."""
        log = MemoryLog()
        with self.memory_file(rank).open(encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    log.unreadable += 1
                    continue
                if record.get("event") == "start":
                    log.start = _start_record(record)
                elif "event" in record:
                    log.events.append(record)
                else:
                    log.samples.append(record)
        return log
