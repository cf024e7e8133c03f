"""A run directory, `<training.output_dir>/<name>/`: the one owner of every file a run writes and reads.

The run directory is the contract between `train` and every later command (`report`, `generate`, `merge`,
`train --resume`, the ranks of `train --gpus`). `RunDir` knows each file's name and format; every other module asks
it for a path or a record, and nobody else composes `run_dir / "x.json"`:

| file | written by | what |
| --- | --- | --- |
| recipe.yaml | train / launch | the fully resolved recipe (`train --recipe runs/NAME/recipe.yaml` reproduces the run) |
| run.json | train (rank 0) | model, data summary, how the recipe was chosen (`Choice`), versions, parameter counts, and the run's `status` (`RunStatus`) |
| plan.json | train (rank 0) | with --vram: the full plan (components, reasons, strategy) |
| data_report.json | train (rank 0) | what the token budget did to the samples, and the batching |
| memory.jsonl | the monitor | memory samples and events; `memory.rank{R}.jsonl` for rank R > 0 |
| status.rank{R}.json | train --gpus, rank R > 0 | that process's own status; the launcher reads them all to say how a failed launch ended |
| memory.png | report | the memory curve |
| metrics.json, log_history.jsonl | train (rank 0) | final metrics and every logged row |
| checkpoints/ | the trainer | resumable checkpoints (`checkpoint-N`); saves in progress under `checkpoints/.staging/` |
| adapter/ or model/ | train | the trained LoRA adapter (+ tokenizer), or the full model |
| accelerate.yaml, launch.json | train --gpus | how the ranks were launched |
| wandb/, tensorboard/ | the trackers (logging.report_to) | W&B's run files (offline runs sync from here), TensorBoard's events |
| .lock | train | held (`fcntl.flock`) by the process running the run; holds its pid |
| .reserve | train (rank 0) | 1 MB of room kept while the run goes, given up to record its end on a full disk |

One meaning per field: `budget_gb` is VRAM − safety margin in plan.json, run.json and memory.jsonl alike.
`memory.jsonl` has one reader, `memory_log`, which tolerates a last line cut short by a crash.

Nothing is lost, nothing half-written is taken for whole:
- JSON records are written to a temporary name and renamed (`os.replace`), so a reader sees the old or the new
  file, never a part. A checkpoint is saved under `checkpoints/.staging/` and renamed to `checkpoint-N` only when
  complete (`lowmem_ft.train.resilience.checkpoints`); `last_checkpoint` takes the newest checkpoint that `checkpoint_problem`
  finds complete (trainer_state.json and weights present and readable) and says which it skipped.
- One process at a time runs a run directory: `lock` holds an exclusive `flock` on `.lock` for the whole run. The
  OS releases it when the process ends, however it ends, so a crashed run never leaves a stale lock.
- A full disk cannot keep a run from saying how it ended: while it runs, the run keeps `.reserve` (`reserve`), and
  a status write that finds the disk full gives it up and writes again (`write_status`).
- run.json's `status` says where the run stands (running with its pid → completed, interrupted or failed with the
  reason). A run that stopped before its first checkpoint can be started again under the same name (`new` clears
  it); one with a checkpoint continues with `--resume`, which first drops the memory samples of the steps it
  will redo (`trim_memory_log`), so memory.jsonl holds each step once.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lowmem_ft.checks import checkpoint_problem  # the one answer to "can training resume from it?"
from lowmem_ft.errors import UserError
from lowmem_ft.memory_log import MemoryLog

if TYPE_CHECKING:
    from lowmem_ft.choosing import Choice
    from lowmem_ft.recipe.schema import Recipe

log = logging.getLogger(__name__)

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' `_re_checkpoint` (trainer_utils.py)
# Room kept for run.json's last write on a full disk: run.json of the tiny test runs is ~6 KB and grows with the data
# summary (one entry per source) and the choice's reasons, not with the steps; 1 MB leaves room for any run's,
# written once more beside itself (write_atomic) — and a filesystem's block rounding.
RESERVE_BYTES = 1 << 20
DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


# The longest file name (one path component) Linux file systems accept: NAME_MAX = 255 bytes (linux/limits.h; ext4,
# xfs, btrfs and tmpfs all keep it). A run directory is named by --name, so a longer one fails at mkdir.
NAME_MAX = 255


def check_run_name(name: str) -> str:
    """A run name is a name: one path component, so the run stays inside `<training.output_dir>/`, and one printable
    line, so the files that name it (recipe.yaml's header comment, accelerate.yaml) stay readable."""
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    if name and not name.isprintable():  # a newline, a NUL: the name heads recipe.yaml and names files
        raise UserError(
            f"--name {name!r}: a run name must be printable on one line (no newline, tab or control character); "
            "pick another --name"
        )
    if not name or name in (".", "..") or any(s in name for s in separators):
        raise UserError(
            f"--name {name!r}: a run name is a name, not a path (no '/', '\\', '..'); the run goes to "
            "<training.output_dir>/<name> — set training.output_dir to choose where"
        )
    if len(name.encode("utf-8")) > NAME_MAX:
        raise UserError(
            f"--name {name[:24]}… ({len(name.encode('utf-8'))} bytes): longer than the {NAME_MAX} bytes a file "
            "name may have (ext4, xfs, btrfs, tmpfs NAME_MAX); pick a shorter --name"
        )
    return name


def default_run_name(model: str) -> str:
    base = Path(model.rstrip("/")).name or "model"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"


@dataclass
class ResumePoint:
    """The newest complete checkpoint of a run (None: there is none), and the newer ones skipped, with why."""

    checkpoint: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def step(self) -> int | None:
        return int(CHECKPOINT.match(self.checkpoint.name).group(1)) if self.checkpoint is not None else None

    def describe(self) -> str:
        skipped = "; ".join(f"skipped {p.name}: {why}" for p, why in self.skipped)
        if self.checkpoint is None:
            return "no complete checkpoint" + (f" ({skipped})" if skipped else "")
        return f"resuming from {self.checkpoint.name} (step {self.step}, the newest complete checkpoint)" + (
            f"; {skipped}" if skipped else ""
        )


State = Literal["running", "completed", "interrupted", "failed"]


@dataclass
class RunStatus:
    """Where a run stands (run.json's `status`): running (pid, host, since when) → completed, interrupted (the
    signal, the step and checkpoint kept) or failed (the one-line reason, the checkpoint kept)."""

    state: State
    pid: int | None = None
    host: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    step: int | None = None
    checkpoint: str | None = None
    reason: str | None = None
    signal: str | None = None  # interrupted: SIGINT or SIGTERM
    rank: int | None = None  # under --gpus: the process whose end this says (run.json: the one that ended the launch)

    @classmethod
    def running(cls) -> RunStatus:
        return cls("running", os.getpid(), socket.gethostname(), _now())

    def ended(self, state: State, **info: Any) -> RunStatus:
        return RunStatus(**{**asdict(self), "state": state, "ended_at": _now(), **info})

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunStatus:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def describe(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        where += f" (rank {self.rank})" if self.rank is not None else ""
        if self.state == "running":
            return f"running (pid {self.pid} on {self.host}, since {self.started_at})"
        why = f" ({self.signal})" if self.signal else f": {self.reason}" if self.reason else ""
        kept = f"; kept {Path(self.checkpoint).name}" if self.checkpoint else ""
        return f"{self.state}{where}{why}{kept}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see the old or the new file, never
    a part (a crash or a full disk leaves the old one)."""
    tmp = unique_tmp(path)
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def unique_tmp(path: Path) -> Path:
    """A temporary name beside `path`, this writer's own: two writers of one file (a run's end and a `report` of it)
    must not write into, or rename, each other's temporary file."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


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
    TENSORBOARD = "tensorboard"
    LOCK = ".lock"
    RESERVE = ".reserve"
    STAGING = ".staging"  # under checkpoints/: a save in progress; `^checkpoint-\d+$` never matches it

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = None  # the open lock file while this object holds the run

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
        """A fresh run directory `<output_dir>/<name>` (default name: model-timestamp), locked for this process.

        A directory that holds a run is refused, unless that run stopped before its first checkpoint (`restartable`):
        then it is cleared and started again.
        """
        run = cls(Path(output_dir) / check_run_name(name or default_run_name(model)))
        run.path.mkdir(parents=True, exist_ok=True)
        run.lock()  # before looking inside: two runs started at once must not both find it empty
        if any(p.name != cls.LOCK for p in run.path.iterdir()):
            why = run.restartable()
            if why is None:
                run.unlock()
                # a finished run cannot be continued (`refuse_finished`): --resume is advice only for one that is not
                done = run.finished()
                go_on = (
                    f"it holds a finished run ({done})" if done is not None else f"continue it with --resume {run.path}"
                )
                raise UserError(f"run directory {run.path} already exists; pick another --name, or {go_on}")
            log.warning("run directory %s: %s; starting it again", run.path, why)
            run.clear()
        return run

    @classmethod
    def existing(cls, path: str | Path) -> RunDir:
        """A run directory written by `train` (it has recipe.yaml), or a UserError saying it is not one."""
        run = cls(path)
        if run.path.exists() and not run.path.is_dir():
            raise UserError(f"{path} is a file, not a run directory; pass runs/<name> of a `lowmem-ft train` run")
        if not run.path.is_dir():
            raise UserError(f"run directory {path} does not exist; pass runs/<name> of a `lowmem-ft train` run")
        if not run.recipe_file.is_file():
            raise UserError(f"{path}: not a run directory (no {cls.RECIPE}); pass runs/<name>")
        return run

    def restartable(self) -> str | None:
        """Why this directory's run may be started again from scratch, or None when it must be kept.

        Only a run that recorded its status and stopped (failed, interrupted, or killed while running: its lock is
        free) with no complete checkpoint and no final weights: nothing in it can be continued or used.
        """
        status = self.read_status()
        if status is None or status.state == "completed":
            return None
        if self.resume_point().checkpoint is not None or self.weights(False).exists() or self.weights(True).exists():
            return None
        how = {
            "failed": f"its run failed before its first checkpoint ({status.reason or 'no reason recorded'})",
            "interrupted": "its run was interrupted before its first checkpoint",
            "running": f"its run (pid {status.pid}) stopped before its first checkpoint without a word (killed?)",
        }
        return how[status.state]

    def clear(self) -> None:
        """Remove everything in the directory but the lock (which this object holds); run.json last, so that a clear
        cut short still says the run may be started again."""
        for item in sorted(self.path.iterdir(), key=lambda p: p == self.info_file):
            if item.name == self.LOCK:
                continue
            if item.is_dir() and not item.is_symlink():
                shutil.rmtree(item)
            else:
                item.unlink()

    # -- the lock ---------------------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Hold the run directory for this process: an exclusive, non-blocking `flock` on `.lock`, kept until
        `unlock` or the end of the process. Held by another process: a UserError naming its pid — unless that
        process launched this one (the ranks of `train --gpus` run under the launcher's lock)."""
        if self._lock is not None:
            return
        try:
            import fcntl
        except ImportError:  # no flock on this OS: runs are not guarded against each other
            return
        self.path.mkdir(parents=True, exist_ok=True)
        handle = (self.path / self.LOCK).open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().split()
            handle.close()
            pid = int(holder[0]) if holder and holder[0].isdigit() else None
            if pid is not None and pid in _ancestors():
                return
            who = f"pid {pid}" + (f" on {holder[1]}" if len(holder) > 1 else "") if pid else "another process"
            raise UserError(
                f"run directory {self.path} is in use by another lowmem-ft run ({who}); wait for it to end, or "
                "pick another --name"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()} {socket.gethostname()}\n")
        handle.flush()
        self._lock = handle

    def unlock(self) -> None:
        if self._lock is None:
            return
        import fcntl

        self._lock.truncate(0)
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None

    @property
    def locked(self) -> bool:
        """Whether this object holds the run directory's lock."""
        return self._lock is not None

    def in_use(self) -> bool:
        """Whether a process holds the run directory's lock now (probed with a shared lock, released at once)."""
        try:
            import fcntl
        except ImportError:
            return False
        if self._lock is not None:
            return True
        try:
            with (self.path / self.LOCK).open("r", encoding="utf-8") as handle:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return False

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
    def staging(self) -> Path:
        """Where checkpoints are saved before they are complete (`lowmem_ft.train.resilience.checkpoints`)."""
        return self.checkpoints / self.STAGING

    @property
    def accelerate_file(self) -> Path:
        return self.path / self.ACCELERATE

    @property
    def launch_file(self) -> Path:
        return self.path / self.LAUNCH

    @property
    def tensorboard(self) -> Path:
        """TensorBoard's event files (with logging.report_to tensorboard)."""
        return self.path / self.TENSORBOARD

    def memory_file(self, rank: int = 0) -> Path:
        """memory.jsonl for rank 0 (and a single process), memory.rank{R}.jsonl for the others."""
        return self.path / ("memory.jsonl" if rank == 0 else f"memory.rank{rank}.jsonl")

    def weights(self, full: bool) -> Path:
        """adapter/ (LoRA adapter + tokenizer), or model/ for a full fine-tune."""
        return self.path / ("model" if full else "adapter")

    @property
    def initial_adapter(self) -> Path:
        """initial_adapter/: a PiSSA / OLoRA adapter as initialised, before step 1 (lowmem_ft.train.init_conversion):
        what the saved adapter is converted against, and what a resumed run rebuilds its residual base from."""
        return self.path / "initial_adapter"

    def staged(self, path: Path) -> Path:
        """Where `path` (a directory of the run, e.g. adapter/) is written before it is renamed into place."""
        return path.with_name(f".{path.name}.partial")

    # -- records ----------------------------------------------------------------------------------------------------
    def _write_json(self, path: Path, data: Any) -> None:
        write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")

    def _read_json(self, path: Path) -> dict[str, Any] | None:
        """A record, or None when it is absent or not a JSON object (a run directory may be damaged or hand-made)."""
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return None
        return data if isinstance(data, dict) else None

    def write_recipe(self, recipe: Recipe) -> None:
        from lowmem_ft.recipe.load import dump

        write_atomic(self.recipe_file, dump(recipe, header=f"resolved recipe of run {self.name}"))

    def read_recipe(self, overrides: list[str] | dict | None = None) -> Recipe:
        """The resolved recipe the run was trained with, plus any new `--set` overrides."""
        from lowmem_ft.recipe.load import resolve

        if not self.recipe_file.is_file():
            raise UserError(f"{self.path}: not a run directory (no {self.RECIPE}); pass runs/<name>")
        return resolve(self.recipe_file, overrides)

    def write_info(self, info: dict[str, Any]) -> None:
        """run.json: `info`, keeping the run's status."""
        status = self.read_info().get("status")
        self._write_json(self.info_file, {**info, "status": status} if status is not None else info)

    def write_status(self, status: RunStatus) -> None:
        """run.json's `status` (the rest of run.json unchanged). On a full disk the reserve (`reserve`) is given up
        and the write tried again: the status a failed run ends with is the one that most needs writing."""
        record = {**self.read_info(), "status": status.to_dict()}
        try:
            self._write_json(self.info_file, record)
        except OSError as exc:
            if exc.errno not in DISK_FULL or not self.release_reserve():
                raise
            self._write_json(self.info_file, record)

    def reserve(self) -> None:
        """Keep `RESERVE_BYTES` of the disk for the run's last status (best effort: a disk too full for it already
        goes without)."""
        path = self.path / self.RESERVE
        try:
            with path.open("wb") as handle:
                handle.write(bytes(RESERVE_BYTES))  # written, not sparse: the blocks are taken now
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            path.unlink(missing_ok=True)
            log.debug("no room reserved in %s for the run's last status: %s", self.path, exc)

    def release_reserve(self) -> bool:
        """Give the reserve back to the disk; whether there was one."""
        path = self.path / self.RESERVE
        existed = path.is_file()
        path.unlink(missing_ok=True)
        return existed

    def read_status(self) -> RunStatus | None:
        """The run's status, or None when run.json records none (a run from before statuses, or not a run)."""
        record = self.read_info().get("status")
        return RunStatus.from_dict(record) if isinstance(record, dict) and "state" in record else None

    def rank_status_file(self, rank: int) -> Path:
        return self.path / f"status.rank{rank}.json"

    def write_rank_status(self, rank: int, status: RunStatus) -> None:
        """The status of rank `rank` of a launch: run.json's for rank 0, its own file for the others."""
        if rank == 0:
            self.write_status(status)
        else:
            self._write_json(self.rank_status_file(rank), status.to_dict())

    def rank_statuses(self, world_size: int) -> dict[int, RunStatus | None]:
        """Each rank's last status (None: the rank recorded none)."""
        out: dict[int, RunStatus | None] = {0: self.read_status()}
        for rank in range(1, world_size):
            record = self._read_json(self.rank_status_file(rank))
            out[rank] = RunStatus.from_dict(record) if record is not None and "state" in record else None
        return out

    def describe_status(self) -> str:
        """The status in words; a run recorded as running whose lock is free ended without a word (killed)."""
        status = self.read_status()
        if status is None:
            return "no status recorded"
        if status.state == "running" and not self.in_use():
            return f"stopped without recording how (pid {status.pid} is gone: killed?); {self.continuation()}"
        return status.describe()

    def read_info(self) -> dict[str, Any]:
        return self._read_json(self.info_file) or {}

    def read_choice(self) -> Choice | None:
        """How the run's recipe was chosen (run.json), or None when the run never wrote it."""
        from lowmem_ft.choosing import Choice

        record = self.read_info().get("choice")
        if not isinstance(record, dict):
            return None
        try:
            return Choice.from_dict(record)
        except (TypeError, ValueError) as exc:
            raise UserError(
                f"{self.info_file}: its choice record is malformed ({exc}); remove run.json to go on without the "
                "original plan's figures"
            ) from None

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
        write_atomic(self.log_history_file, "".join(json.dumps(row) + "\n" for row in history))

    def write_launch(self, accelerate_config: str, info: dict[str, Any]) -> None:
        write_atomic(self.accelerate_file, accelerate_config)
        self._write_json(self.launch_file, info)

    def read_launch(self) -> dict[str, Any]:
        info = self._read_json(self.launch_file)
        if not self.recipe_file.is_file() or info is None or not isinstance(info.get("choice"), dict):
            raise UserError(
                f"--run-dir {self.path}: not a prepared run (needs {self.RECIPE} and {self.LAUNCH} from --gpus)"
            )
        return info

    def checkpoint_dirs(self) -> list[Path]:
        """The `checkpoint-N` directories, newest (highest N) first, complete or not."""
        if not self.checkpoints.is_dir():
            return []
        found = [p for p in self.checkpoints.iterdir() if CHECKPOINT.match(p.name) and p.is_dir()]
        return sorted(found, key=lambda p: int(CHECKPOINT.match(p.name).group(1)), reverse=True)

    def resume_point(self) -> ResumePoint:
        """The newest complete checkpoint (`checkpoint_problem`), and the newer incomplete ones it skipped."""
        skipped = []
        for path in self.checkpoint_dirs():
            problem = checkpoint_problem(path)
            if problem is None:
                return ResumePoint(path, skipped)
            skipped.append((path, problem))
        return ResumePoint(None, skipped)

    def resumable(self) -> ResumePoint:
        """The resume point of `--resume`; with no complete checkpoint, the one refusal (the run unlocked first)."""
        point = self.resume_point()
        if point.checkpoint is None:
            self.unlock()
            raise UserError(
                f"--resume {self.path}: {point.describe()}, nothing to continue; start the run again without "
                "--resume (same --name)"
            )
        return point

    def last_checkpoint(self) -> Path | None:
        """The checkpoint to resume from: the newest complete one, or None."""
        return self.resume_point().checkpoint

    def finished(self) -> str | None:
        """What a finished run holds (its end and its weights), or None when it is not finished. Finished: run.json
        says completed — or, for a run from before statuses, metrics.json of a run that was not interrupted, beside
        its weights."""
        status = self.read_status()
        weights = next((w for w in (self.weights(False), self.weights(True)) if w.is_dir()), None)
        if status is not None and status.state != "completed":
            return None
        metrics = self.read_metrics()
        if status is None and (weights is None or metrics is None or "interrupted" in metrics):
            return None
        step = status.step if status is not None and status.step is not None else (metrics or {}).get("global_step")
        at = f" at step {step}" if step is not None else ""
        return f"completed{at}" + (f", weights in {weights}" if weights is not None else "")

    def refuse_finished(self, flag: str = "--resume") -> None:
        """A UserError (the lock given back) when the run is finished: continuing it would train past its last step
        and rewrite its weights. Training further is a new run from those weights."""
        done = self.finished()
        if done is None:
            return
        self.unlock()
        weights = next((w for w in (self.weights(False), self.weights(True)) if w.is_dir()), None)
        how = (
            f"start a new run from them: lowmem-ft train --{'model' if weights.name == 'model' else 'adapter'} "
            f"{weights} ..."
            if weights is not None
            else "start a new run"
        )
        raise UserError(f"{flag} {self.path}: the run finished ({done}); nothing to continue — to train further, {how}")

    def continuation(self, flags: str = "") -> str:
        """What the directory holds to go on from, and the command that does (the end of a run's last line);
        `flags`: what the command needs beyond the run directory (GRPO's --reward-fn, never in the recipe)."""
        point = self.resume_point()
        if point.checkpoint is None:
            return f"no checkpoint kept; start the run again with the same command (it reuses {self.path})"
        more = f" {flags}" if flags else ""
        return f"kept {point.checkpoint} (step {point.step}); continue with: lowmem-ft train --resume {self.path}{more}"

    def checkpoint_size(self) -> int:
        """Bytes of the newest complete checkpoint (0 when there is none): what the next save will take."""
        last = self.last_checkpoint()
        return sum(p.stat().st_size for p in last.rglob("*") if p.is_file()) if last is not None else 0

    def clear_staging(self) -> None:
        """Remove what a save cut short left: `checkpoints/.staging/`, `.adapter.partial`. A checkpoint it was
        replacing (moved aside as `replaced-checkpoint-N` before the new one took its name) is put back when the new
        one never arrived."""
        for partial in self.path.glob(".*.partial*"):
            shutil.rmtree(partial, ignore_errors=True)
        if not self.staging.is_dir():
            return
        for item in self.staging.iterdir():
            final = self.checkpoints / item.name.removeprefix("replaced-")
            if item.name.startswith("replaced-") and not final.exists():
                os.replace(item, final)
                log.info("put back %s, which an interrupted save was replacing", final.name)
        log.info("removing the incomplete save(s) %s", ", ".join(p.name for p in self.staging.iterdir()) or "-")
        shutil.rmtree(self.staging, ignore_errors=True)

    def trim_memory_log(self, step: int, rank: int = 0) -> int:
        """Drop the samples (and start records) of steps after `step` — the steps a run resumed from checkpoint
        `step` redoes — so each step is in the file once; events stay, as history. Rewritten atomically; returns
        how many records were dropped (unreadable lines count too)."""
        path = self.memory_file(rank)
        if not path.is_file():
            return 0
        kept, dropped = [], 0
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += line.strip() != ""
                continue
            redone = record.get("step", 0) > step and record.get("event") in (None, "start")
            if redone:
                dropped += 1
            else:
                kept.append(line)
        if dropped:
            write_atomic(path, "".join(line + "\n" for line in kept))
        return dropped

    def memory_log(self, rank: int = 0) -> MemoryLog:
        """The records of a memory file, tolerating a last line cut short by a crash (see `MemoryLog.read`)."""
        with self.memory_file(rank).open(encoding="utf-8", errors="replace") as handle:  # bad bytes: unreadable
            return MemoryLog.read(handle, self.in_use)


def _ancestors() -> set[int]:
    """Process ids above this one (parent, grandparent, …)."""
    try:
        import psutil

        return {p.pid for p in psutil.Process().parents()}
    except Exception:  # psutil missing or /proc unreadable: no one counts as a parent
        return {os.getppid()}
