"""How a run ends, recorded: run.json's status and every ending said in one line.

The one idea: around building, training and saving (`RunRecord.around`), the run's status goes running →
completed, interrupted or failed with the one-line reason, SIGINT/SIGTERM are answered by a checkpoint after the
step in progress (`lowmem_ft.train.resilience.interrupt`), and every way a run can fail is said as what was kept and
how to go on (`--resume`, or the same command again when nothing was kept). A bug keeps its traceback.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lowmem_ft.errors import Interrupted, UserError
from lowmem_ft.rundir import RunDir, RunStatus
from lowmem_ft.train.distributed.ranks import lost_peer
from lowmem_ft.train.methods.rewards import RewardFailed

log = logging.getLogger(__name__)


def resume_point(run: RunDir) -> tuple[Path, int]:
    """The newest complete checkpoint of `run` and its step, said with what was skipped and how the run before
    ended; a UserError when there is none."""
    point = run.resumable()
    before = run.read_status()
    if before is not None:  # running: it had no time to record its end (killed, or the machine went down)
        ended = "stopped without recording how" if before.state == "running" else before.describe()
        log.info("%s: the run before this one %s", run.path, ended)
    (log.warning if point.skipped else log.info)("%s", point.describe())
    return point.checkpoint, point.step


class RunRecord:
    """The record of one process's run in `run`: its rank's status, the signal handlers (`stop`), the directory's
    lock released at the end. `trainer` returns the run's trainer once it is built (None before)."""

    def __init__(
        self, run: RunDir, rank: int, world_size: int, stop, trainer: Callable[[], Any], again: tuple[str, ...] = ()
    ):
        self.run, self.rank, self.world_size, self.stop = run, rank, world_size, stop
        self.trainer = trainer
        self.again = again  # flags the continuing command must repeat (GRPO's --reward-fn): command line only
        self.status: RunStatus | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        """Around build, fit and finalize: run.json's status (running → completed / interrupted / failed), the
        signal handlers, and every ending as one line; the run directory unlocked at the end."""
        self.stop.install()
        if self.is_main:
            self.run.reserve()  # room to record the end on a disk that fills meanwhile
        # under --gpus every rank records its own status (rank 0 in run.json): the launcher reads them all to say
        # which rank ended the launch and how (`lowmem_ft.train.distributed.launch.settle`)
        self.status = RunStatus.running()
        if self.world_size > 1:
            self.status.rank = self.rank
        self._record(self.status)
        try:
            yield
        except BaseException as exc:
            ending = self._ending(exc)
            if ending is exc:
                raise
            raise ending from None
        else:
            self._end("completed", step=self.trainer().state.global_step)
        finally:
            self.stop.uninstall()
            if self.is_main:
                self.run.release_reserve()
            self.run.unlock()

    def _record(self, status: RunStatus) -> None:
        try:
            self.run.write_rank_status(self.rank, status)
        except OSError as exc:  # a full disk: the run's end is said on the console all the same
            log.warning("could not record the run's status (%s) in %s: %s", status.state, self.run.info_file, exc)

    def _end(self, state: str, **info: Any) -> None:
        if self.status is None:
            return
        if state != "completed":  # what --resume would continue from
            kept = self.run.last_checkpoint()
            info["checkpoint"] = str(kept) if kept is not None else None
        self._record(self.status.ended(state, **info))

    def _ending(self, exc: BaseException) -> BaseException:
        """Record how the run ended and return the error to raise: one line (with what was kept and how to go on)
        for everything but a bug."""
        from lowmem_ft.train.resilience.checkpoints import DiskFull, is_disk_full

        trainer = self.trainer()
        step = trainer.state.global_step if trainer is not None else None
        if isinstance(exc, KeyboardInterrupt):  # a second Ctrl-C: abort at once
            exc = Interrupted(f"aborted by a second SIGINT during step {(step or 0) + 1}", signal.SIGINT)
        if isinstance(exc, Interrupted):
            exc = Interrupted(f"{exc}; {self.run.continuation(self.again)}", exc.signum)
            self._end("interrupted", step=step, reason=str(exc), signal=signal.Signals(exc.signum).name)
            return exc
        if not isinstance(exc, DiskFull) and is_disk_full(exc):
            exc = self._disk_full(exc)
        if self.world_size > 1 and lost_peer(exc):  # another rank died or hung: the launcher names which
            exc = UserError(f"rank {self.rank} lost the other ranks at a collective ({first_line(exc)})")
        if isinstance(exc, RewardFailed):  # at a step: the run stops, its last checkpoint kept, and says how to go on
            exc = RewardFailed(f"{exc}; {self.run.continuation(self.again)}")
        if isinstance(exc, UserError):
            self._end("failed", step=step, reason=str(exc))
            return exc
        self._end("failed", step=step, reason=f"{type(exc).__name__}: {first_line(exc)}"[:500])
        return exc

    def _disk_full(self, exc: BaseException):
        """A full disk outside a checkpoint save (memory log, final weights, run files): the same one line."""
        from lowmem_ft.train.resilience.checkpoints import Saver

        trainer = self.trainer()
        saver = trainer.saver if trainer is not None else Saver(self.run)
        if trainer is not None and not saver.needed:
            saver.needed = saver.expected_bytes(trainer)
        return saver.disk_full(f"writing {filename(exc) or self.run.path}")


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def filename(exc: BaseException | None) -> str | None:
    """The file a failed write names, on the exception or one it came from."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "filename", None):
            return str(exc.filename)
        exc = exc.__cause__ or exc.__context__
    return None
