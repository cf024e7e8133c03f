"""Checkpoints that are whole or absent, and a full disk said in one line.

transformers 5.24's `Trainer._save_checkpoint` writes straight into `checkpoints/checkpoint-N`, and
`get_last_checkpoint` takes the highest-numbered such directory whatever its state: a save cut short (the process
killed, the disk full) left a partial checkpoint that broke `--resume` though a complete one existed. transformers'
own answer (`enable_jit_checkpoint`'s `checkpoint-is-incomplete.txt` sentinel) covers its SIGTERM save only, and
`get_last_checkpoint` does not read the sentinel. So `MemorySafeSFTTrainer._save_checkpoint` runs transformers' save
unchanged, into `checkpoints/.staging/checkpoint-N` (a name `^checkpoint-\\d+$` never matches), and this module:

- checks before the save that the disk has room for it (`Saver.check_space`): the size of the last complete
  checkpoint, or before the first one an estimate from the tensors it will hold (trainable weights, optimizer
  states) and the tokenizer file — all ranks agree on the answer, so none enters a save the others skip;
- after every rank has written its part, fsyncs the staged files and renames the directory to `checkpoint-N`
  (`Saver.publish`, on the process that writes the run directory), then rotates old checkpoints as transformers would;
- turns a failed save into one line (`DiskFull`) when the disk is full — by errno, by the writer's message
  (safetensors says "os error 28"), or, for torch's zip writer, which says only "unexpected pos", by the free space
  left being below what the save needs — after removing the partial staging directory. A torch writer's failure
  with room on the disk again (full for an instant) is one line too, naming both likely causes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

import torch
from transformers.trainer_utils import rotate_checkpoints

from lowmem_ft.errors import UserError
from lowmem_ft.rundir import RunDir
from lowmem_ft.train.distributed.ranks import any_rank, barrier, world_size

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# How writers say it without an errno: Python's strerror, and safetensors' Rust I/O error ("... (os error 28)").
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
# A checkpoint's files besides the tensors and the tokenizer: trainer_state.json (~1 KB per logged row),
# rng_state.pth, scheduler.pt, training_args.bin, adapter_config.json, peft's README.md — under 100 KB each in the
# tiny test runs (tests/train/resilience/test_checkpoints.py lists them); 1 MB covers a long log history.
SLACK_BYTES = 1_000_000
# torch's zip writer (caffe2 serialize/inline_container.cc) names no errno when a write fails: "PytorchStreamWriter
# failed writing file data/0: file write failed", "unexpected pos N vs M". By the time it is looked at, a disk that
# was full for an instant has room again, so neither errno nor free space says what it was.
WRITER_TEXT = ("file write failed", "unexpected pos")
ENFORCE = re.compile(r"^\[enforce fail at [^\]]*\]\s*\.?\s*")


class DiskFull(UserError):
    """The disk cannot hold the next checkpoint: the run stopped with what it had kept."""


def size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or an exception it came from) says the disk or the quota is full."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(exc) for text in DISK_FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(directory: Path) -> int:
    """Free space where `directory` is (its nearest existing parent), as an unprivileged process may use it."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return shutil.disk_usage(directory).free


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on a directory; its files were flushed
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file under `path`, then the directories, to the disk: a rename must not publish data still in
    the page cache (after a power loss the name would exist with empty files)."""
    for item in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [path]:
        _fsync(item)


def rename_into_place(staged: Path, final: Path, aside: Path | None = None) -> None:
    """Rename a complete staged directory to its final name. One already there (a checkpoint of the same step: the
    save before an out-of-memory stop repeats the step's save; adapter/ of a resumed run) is moved to `aside` first
    (default: `replaced-<name>` beside the staged one) and removed after; a crash between the two renames leaves it
    in the staging directory, where `RunDir.clear_staging` puts a checkpoint back."""
    fsync_tree(staged)
    if final.exists():
        aside = aside or staged.parent / f"replaced-{final.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(staged, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(staged, final)
    _fsync(final.parent)


class Saver:
    """Atomic checkpoint saves and disk-space checks for the trainer of one run directory."""

    def __init__(self, run: RunDir):
        self.run = run
        self.needed = 0  # bytes the last checked save was expected to take

    def expected_bytes(self, trainer) -> int:
        """What the next checkpoint will take: the last complete checkpoint's size (a measurement), or before the
        first one, its tensors (trainable weights, optimizer states; × the world size when sharded) + the
        tokenizer file + `SLACK_BYTES`."""
        measured = self.run.checkpoint_size()
        if measured:
            return measured
        tensors = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
        optimizer = getattr(trainer, "optimizer", None)
        for state in getattr(optimizer, "state", {}).values():
            tensors += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
            tensors *= world_size()
        backend = getattr(trainer.processing_class, "backend_tokenizer", None)
        tokenizer = len(backend.to_str().encode()) if backend is not None else 0
        return tensors + tokenizer + SLACK_BYTES

    def check_space(self, trainer, step: int) -> None:
        """DiskFull before a save the disk cannot hold; every rank takes the same decision (one all-reduce)."""
        self.needed = self.expected_bytes(trainer)
        free = free_bytes(self.run.checkpoints)
        if any_rank(free < self.needed, trainer.args.device):
            raise self.disk_full(f"saving checkpoint-{step}", free)

    def disk_full(self, what: str, free: int | None = None) -> DiskFull:
        """The one line: free space, what a checkpoint needs, what was kept and how to go on."""
        directory = self.run.checkpoints if self.run.checkpoints.is_dir() else self.run.path
        free = free_bytes(directory) if free is None else free
        needs = f", a checkpoint needs about {size(self.needed)}" if self.needed else ""
        return DiskFull(f"disk full while {what}: {size(free)} free in {directory}{needs}; {self.run.continuation()}")

    def failed(self, exc: BaseException, step: int) -> BaseException:
        """A save that raised: its partial staging directory removed; DiskFull when the disk is full (see the
        module docstring), else the error itself."""
        free = free_bytes(self.run.checkpoints)  # before the partial save's space is given back
        shutil.rmtree(self.run.staging / f"checkpoint-{step}", ignore_errors=True)
        self._tidy()
        if is_disk_full(exc) or free < self.needed:
            return self.disk_full(f"saving checkpoint-{step}", free)
        if any(text in str(exc) for text in WRITER_TEXT):
            return self.write_failed(f"checkpoint-{step}", exc, free)
        return exc

    def write_failed(self, what: str, exc: BaseException, free: int) -> DiskFull:
        """A write that failed without saying why (torch's writer): one line, with the likely causes."""
        directory = self.run.checkpoints if self.run.checkpoints.is_dir() else self.run.path
        said = ENFORCE.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        return DiskFull(
            f"could not write {what} ({said}): a disk full for a moment, or a failing disk; {size(free)} free now in "
            f"{directory}; {self.run.continuation()}"
        )

    def _tidy(self) -> None:
        with contextlib.suppress(OSError):  # the staging directory, empty now: no leftover to wonder about
            self.run.staging.rmdir()

    def publish(self, trainer, step: int) -> Path:
        """Rename the staged checkpoint to `checkpoint-{step}`, its best-checkpoint path pointing at final names;
        on the process that writes the run directory, after every rank has written (call on all ranks)."""
        staged, final = self.run.staging / f"checkpoint-{step}", self.run.checkpoints / f"checkpoint-{step}"
        state = trainer.state
        best = state.best_model_checkpoint
        if best is not None and Path(best).parent == self.run.staging:  # transformers named it inside the stage
            state.best_model_checkpoint = str(self.run.checkpoints / Path(best).name)
        barrier()
        if trainer.args.should_save:
            if best != state.best_model_checkpoint:
                state.save_to_json(str(staged / "trainer_state.json"))
            rename_into_place(staged, final)
            self._tidy()
            rotate_checkpoints(
                output_dir=str(self.run.checkpoints),
                save_total_limit=trainer.args.save_total_limit,
                best_model_checkpoint=state.best_model_checkpoint,
                use_mtime=False,  # the step in the name orders them; mtime ties within a second on fast runs and
            )  # then transformers warns "mtime may not be reliable" on every save
        barrier()
        return final
