"""Checkpoints are whole or absent, and a full disk is one line saying what was kept and what a save needs.

The full disks are real where the tests run as root: a small tmpfs holds the run directory and a ballast file fills
it at the moment a test chooses. One test patches the writer instead (named so), to run anywhere.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback

from lowmem_ft import cli
from lowmem_ft.rundir import RunDir, checkpoint_problem
from lowmem_ft.train import run as run_module
from lowmem_ft.train.resilience.checkpoints import SLACK_BYTES, is_disk_full
from tests.train.tiny_runs import tiny_run, tiny_sets

pytestmark = pytest.mark.slow
DATA = "tests/data/numbered.jsonl"
ADAPTER = "adapter/adapter_model.safetensors"
SHIPPED = ("adapter.dropout=0.05", "training.max_steps=3", "training.save_steps=1")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory) -> Path:
    return tiny_run(tiny_model, DATA, tmp_path_factory.mktemp("runs"), "baseline", *SHIPPED).run_dir


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MB tmpfs (needs root and the mount syscall; skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill the disk with a ballast file, then give back `leave` bytes."""
    ballast = disk / "ballast"
    with ballast.open("ab") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    os.truncate(ballast, max(0, ballast.stat().st_size - leave))
    return ballast


def train_cli(tiny_model, out: Path, monkeypatch, *callbacks) -> int:
    train = run_module.train
    monkeypatch.setattr(run_module, "train", lambda *a, **k: train(*a, **{**k, "callbacks": list(callbacks)}))
    argv = ["train", "--recipe", "8gb", "--name", "full", "--no-wandb"]
    for item in tiny_sets(tiny_model, DATA, out, *SHIPPED):
        argv += ["--set", item]
    return cli.main(argv)


def the_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "lowmem-ft train: error: " in x]
    return line.partition("lowmem-ft train: error: ")[2]


def assert_same_adapter(run: Path, baseline: Path) -> None:
    a, b = load_file(run / ADAPTER), load_file(baseline / ADAPTER)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def resume(run: Path) -> int:
    return cli.main(["train", "--resume", str(run), "--no-wandb"])


class AfterSave(TrainerCallback):
    """Call `fn()` once, after the checkpoint of step `step` is saved."""

    def __init__(self, step: int, fn):
        self.step, self.fn = step, fn

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.fn()


def test_a_full_disk_is_seen_before_the_save(tiny_model, small_disk, baseline, monkeypatch, capsys):
    """Disk full at a save used to give five chained tracebacks, a 0-byte memory.png and a partial checkpoint that
    broke resume. Here the disk has 100 KB left after checkpoint-1; checkpoint-2 needs about its size."""
    ballast = []
    code = train_cli(
        tiny_model, small_disk, monkeypatch, AfterSave(1, lambda: ballast.append(fill(small_disk, 100_000)))
    )
    assert code == 2
    run = small_disk / "full"
    size = RunDir(run).checkpoint_size()
    line = the_error(capsys)
    assert line.startswith(f"disk full while saving checkpoint-2: 0.1 MB free in {run}/checkpoints, a checkpoint")
    assert line.endswith(
        f"needs about {size / 1e6:.1f} MB; kept {run}/checkpoints/checkpoint-1 (step 1); continue with: lowmem-ft "
        f"train --resume {run}"
    )
    assert [p.name for p in RunDir(run).checkpoint_dirs()] == ["checkpoint-1"] and not RunDir(run).staging.exists()
    png = run / "memory.png"
    assert not png.exists() or png.stat().st_size > 0
    status = RunDir(run).read_status()
    assert status.state == "failed" and status.reason == line and status.step == 2  # steps done; 2 is lost

    ballast[0].unlink()
    monkeypatch.undo()
    assert resume(run) == 0
    assert_same_adapter(run, baseline)


def test_a_disk_that_fills_during_the_save(tiny_model, small_disk, baseline, monkeypatch, capsys):
    """The save of step 2 starts with room to spare; the disk fills while it writes (a ballast written from inside
    the save, after the weights). torch's zip writer then fails without an errno ("unexpected pos"): the free space
    left says it was the disk."""
    save_rng_state = Trainer._save_rng_state
    ballast = []

    def filling(self, output_dir):
        if self.state.global_step == 2 and not ballast:
            ballast.append(fill(small_disk))
        return save_rng_state(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", filling)
    assert train_cli(tiny_model, small_disk, monkeypatch) == 2
    run = small_disk / "full"
    line = the_error(capsys)
    assert line.startswith(f"disk full while saving checkpoint-2: 0.0 MB free in {run}/checkpoints")
    assert line.endswith(f"kept {run}/checkpoints/checkpoint-1 (step 1); continue with: lowmem-ft train --resume {run}")
    assert [p.name for p in RunDir(run).checkpoint_dirs()] == ["checkpoint-1"]
    assert not RunDir(run).staging.exists()  # the partial save is gone
    png = run / "memory.png"
    assert not png.exists() or png.stat().st_size > 0  # never a 0-byte plot

    ballast[0].unlink()
    monkeypatch.undo()
    assert resume(run) == 0
    assert_same_adapter(run, baseline)


def test_a_full_disk_with_a_patched_writer(tiny_model, tmp_path, monkeypatch, capsys):
    """The same path without a real full disk (runs anywhere): the optimizer writer writes half a file, then raises
    ENOSPC as a full disk would."""

    def half_written(self, output_dir):
        Path(output_dir, "optimizer.pt").write_bytes(b"PK\3\4 half")
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir, "optimizer.pt")))

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", half_written)
    assert train_cli(tiny_model, tmp_path, monkeypatch) == 2
    run = tmp_path / "full"
    line = the_error(capsys)
    assert line.startswith("disk full while saving checkpoint-1: ") and "no checkpoint kept" in line
    assert not RunDir(run).checkpoint_dirs() and not RunDir(run).staging.exists()
    assert RunDir(run).read_status().state == "failed"
    monkeypatch.undo()
    # nothing was kept, so the same command starts the run again in the same directory
    assert train_cli(tiny_model, tmp_path, monkeypatch) == 0


def test_a_failed_save_leaves_no_checkpoint_behind(tiny_model, tmp_path, monkeypatch):
    """A save that fails for another reason: its partial directory is removed, the error (a bug) is not hidden."""
    save_rng_state = Trainer._save_rng_state

    def broken(self, output_dir):
        if self.state.global_step == 2:
            raise RuntimeError("boom")
        return save_rng_state(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", broken)
    with pytest.raises(RuntimeError, match="boom"):
        tiny_run(tiny_model, DATA, tmp_path, "broken", *SHIPPED)
    run = RunDir(tmp_path / "broken")
    assert [p.name for p in run.checkpoint_dirs()] == ["checkpoint-1"] and not run.staging.exists()
    status = run.read_status()
    assert status.state == "failed" and status.reason == "RuntimeError: boom" and not run.in_use()


def test_saves_are_renamed_into_place_and_rotated(tiny_model, tmp_path):
    """With eval data the best checkpoint is kept: its recorded path is the final one, not the staging one."""
    result = tiny_run(
        tiny_model, DATA, tmp_path, "eval", "adapter.dropout=0.05", "training.max_steps=4", "training.save_steps=1",
        "training.eval_steps=1", "data.eval_fraction=0.1", "training.save_total_limit=2",
    )  # fmt: skip
    run = RunDir(result.run_dir)
    names = [p.name for p in run.checkpoint_dirs()]
    best = Path(result.metrics["best_checkpoint"])
    assert best.parent == run.checkpoints and best.name in names and "checkpoint-4" in names
    assert len(names) <= 3 and not run.staging.exists()  # 2 kept, + the best when it is older
    for path in run.checkpoint_dirs():
        assert checkpoint_problem(path) is None
        state = json.loads((path / "trainer_state.json").read_text())
        assert ".staging" not in json.dumps(state)


def test_the_first_save_is_estimated_above_its_size(tiny_model, tmp_path):
    """Before the first checkpoint the space check estimates it: tensors + tokenizer + SLACK_BYTES. The estimate
    covers the files it does not count (trainer state, RNG state, scheduler, training args, adapter config, card)."""
    estimates = []

    class Estimate(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                estimates.append(trainer.saver.expected_bytes(trainer))

    from tests.train.tiny_runs import tiny_trainer

    job = tiny_trainer(tiny_model, DATA, tmp_path, "training.max_steps=1", "training.save_steps=1")
    trainer = job.trainer
    trainer.add_callback(Estimate())
    job.fit()
    checkpoint = job.run.last_checkpoint()
    files = {p.name: p.stat().st_size for p in checkpoint.iterdir()}
    counted = files["adapter_model.safetensors"] + files["optimizer.pt"] + files["tokenizer.json"]
    rest = sum(files.values()) - counted
    assert rest < SLACK_BYTES / 4, files  # what SLACK_BYTES stands for, with room for a long log history
    (estimate,) = estimates
    assert sum(files.values()) <= estimate <= sum(files.values()) + SLACK_BYTES
    assert job.run.checkpoint_size() == sum(files.values())  # the next save is checked against this measurement


def test_a_checkpoint_of_the_same_step_is_replaced_whole(tmp_path):
    """The save before an out-of-memory stop repeats the step's save: the old one makes way only at the rename."""
    from lowmem_ft.train.resilience.checkpoints import rename_into_place

    staging, final = tmp_path / ".staging", tmp_path / "checkpoint-2"
    (staging / "checkpoint-2").mkdir(parents=True)
    (staging / "checkpoint-2" / "new").write_text("new")
    final.mkdir()
    (final / "old").write_text("old")
    rename_into_place(staging / "checkpoint-2", final)
    assert [p.name for p in final.iterdir()] == ["new"] and not any(staging.iterdir())


@pytest.mark.parametrize(
    "exc,full",
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), True),
        (OSError(errno.EACCES, "Permission denied"), False),
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"), False),
    ],
)
def test_is_disk_full(exc, full):
    assert is_disk_full(exc) is full
    try:
        raise RuntimeError("wrapped") from exc
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped) is full


def test_rotation_orders_checkpoints_by_step_not_mtime(tmp_path, caplog):
    """Saves a second apart share an mtime on fast runs: rotation keeps the newest steps (9 and 10, not 10 and 8
    by name), and transformers' "mtime may not be reliable" warning never reaches the console."""
    from types import SimpleNamespace

    from transformers.utils import logging as hf_logging

    from lowmem_ft.train.resilience.checkpoints import Saver

    run = RunDir(tmp_path / "run")
    for step in (8, 9):
        (run.checkpoints / f"checkpoint-{step}").mkdir(parents=True)
    (run.staging / "checkpoint-10").mkdir(parents=True)
    for path in [*run.checkpoints.iterdir(), run.staging / "checkpoint-10"]:
        os.utime(path, (1_000_000, 1_000_000))
    trainer = SimpleNamespace(args=SimpleNamespace(should_save=True, save_total_limit=2),
                              state=SimpleNamespace(best_model_checkpoint=None))  # fmt: skip
    hf_logging.enable_propagation()
    try:
        Saver(run).publish(trainer, 10)
    finally:
        hf_logging.disable_propagation()
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["checkpoint-10", "checkpoint-9"]
    assert not [r for r in caplog.records if "mtime" in r.getMessage()]


# ---- a full disk at any write (issue #24): one line, run.json failed with the reason -----------------------------
class AtStep(TrainerCallback):
    """Call `fn()` once, at the start of optimizer step `step` (0: at the end of training, before the final save)."""

    def __init__(self, step: int, fn):
        self.step, self.fn = step, fn

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self.fn()

    def on_train_end(self, args, state, control, **kwargs):
        if self.step == 0:
            self.fn()


class FullAppends:
    """A memory log's file on a full disk whose last page is full too: every flush fails (a real tmpfs takes the
    tiny run's ~1 KB per step into the page memory.jsonl already holds, so the patch stands in for a longer log)."""

    def __init__(self, handle):
        self.handle = handle

    def write(self, text):
        return len(text)

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self.handle.close()
        self.flush()


def test_a_disk_that_fills_while_the_memory_log_is_written(tiny_model, small_disk, baseline, monkeypatch, capsys):
    """The disk fills during step 2 (for real) and the memory log's flush at the step's end is the write that fails
    (patched, see FullAppends). The run stops with one line and run.json says failed and why (it stayed `running`:
    its own write failed too); freed, the run resumes to the uninterrupted adapter."""
    from lowmem_ft.train.observe.monitor import MemoryMonitor

    ballast, on_train_begin = [], MemoryMonitor.on_train_begin

    def full(monitor):
        ballast.append(fill(small_disk))
        monitor._file = FullAppends(monitor._file)

    def watched(self, *args, **kwargs):
        on_train_begin(self, *args, **kwargs)
        monitors.append(self)

    monitors: list = []
    monkeypatch.setattr(MemoryMonitor, "on_train_begin", watched)
    assert train_cli(tiny_model, small_disk, monkeypatch, AtStep(2, lambda: full(monitors[0]))) == 2
    run = small_disk / "full"
    line = the_error(capsys)
    assert line.startswith(f"disk full while writing {run}/memory.jsonl: ")
    assert line.endswith(f"kept {run}/checkpoints/checkpoint-1 (step 1); continue with: lowmem-ft train --resume {run}")
    status = RunDir(run).read_status()
    assert (status.state, status.reason, status.step) == ("failed", line, 2)  # ended after step 2
    assert not (run / ".reserve").exists()
    ballast[0].unlink()
    monkeypatch.undo()
    assert resume(run) == 0
    assert_same_adapter(run, baseline)


def test_a_disk_full_at_the_final_save_is_recorded(tiny_model, small_disk, monkeypatch, capsys):
    ballast = []
    assert train_cli(tiny_model, small_disk, monkeypatch, AtStep(0, lambda: ballast.append(fill(small_disk)))) == 2
    run = small_disk / "full"
    line = the_error(capsys)
    assert line.startswith("disk full while ") and "kept " in line and "checkpoint-3 (step 3)" in line
    status = RunDir(run).read_status()
    assert (status.state, status.reason) == ("failed", line)
    assert not (run / "adapter").exists()


def test_a_write_that_fails_for_an_instant_is_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    """torch's zip writer names no errno ("file write failed", "unexpected pos"); a disk full only for an instant
    has room again by the time the failure is looked at. It printed a ~45-line traceback; it is one line, and the
    run is recorded as failed."""
    save = torch.save

    def failing(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt") and "checkpoint-2" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed")  # fmt: skip
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing)
    assert train_cli(tiny_model, tmp_path, monkeypatch) == 2
    run = tmp_path / "full"
    line = the_error(capsys)
    assert line.startswith("could not write checkpoint-2 (PytorchStreamWriter failed writing file data/0: file write")
    assert "a disk full for a moment" in line and f"kept {run}/checkpoints/checkpoint-1 (step 1)" in line
    status = RunDir(run).read_status()
    assert (status.state, status.reason) == ("failed", line)
    assert [p.name for p in RunDir(run).checkpoint_dirs()] == ["checkpoint-1"] and not RunDir(run).staging.exists()
