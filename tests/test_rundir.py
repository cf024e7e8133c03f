"""The run directory: names stay names, every file has one owner, records read back as written, one run at a
time, and nothing half-written is taken for whole."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lowmem_ft.choosing import Choice
from lowmem_ft.errors import UserError
from lowmem_ft.memory.target import Target
from lowmem_ft.recipe.load import resolve
from lowmem_ft.rundir import RunDir, RunStatus, checkpoint_problem


@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", ".", "/tmp/abs", "a\\b"])
def test_a_run_name_is_not_a_path(tmp_path, name):
    """`--name ../escaped` or an absolute path used to write outside <training.output_dir>/."""
    out = tmp_path / "runs"
    with pytest.raises(UserError, match="a run name is a name, not a path"):
        RunDir.new(out, name, "m")
    assert not (tmp_path / "escaped").exists() and not any(tmp_path.rglob("*.json"))


def test_new_runs_are_named_and_never_overwritten(tmp_path):
    run = RunDir.new(tmp_path, None, "Qwen/Qwen2.5-7B/")
    assert run.path.parent == tmp_path and run.name.startswith("Qwen2.5-7B-") and run.path.is_dir()
    run.recipe_file.write_text("x")
    run.unlock()
    with pytest.raises(UserError, match="already exists; pick another --name, or continue it with --resume"):
        RunDir.new(tmp_path, run.name, "m")
    empty = RunDir.new(tmp_path, "empty", "m")
    empty.unlock()
    assert RunDir.new(tmp_path, "empty", "m").path == empty.path  # empty (but for its lock file): reused


def test_a_run_directory_in_use_is_refused(tmp_path):
    """Two runs with the same --name at once both used to exit 0, one overwriting the other."""
    first = RunDir.new(tmp_path, "same", "m")
    assert first.locked and first.in_use()
    message = f"run directory {first.path} is in use by another lowmem-ft run (pid {os.getpid()} on "
    with pytest.raises(UserError, match=re.escape(message)):
        RunDir.new(tmp_path, "same", "m")
    with pytest.raises(UserError, match="is in use"):
        RunDir(first.path).lock()  # --resume takes the same lock
    first.unlock()
    assert not first.in_use() and not RunDir(first.path).in_use()
    second = RunDir(first.path)
    second.lock()
    second.lock()  # held already: nothing to do
    assert second.locked and (first.path / ".lock").read_text().split()[0] == str(os.getpid())
    second.unlock()


def test_the_ranks_of_a_launch_run_under_the_launchers_lock(tmp_path):
    """`train --gpus` holds the lock while its ranks (child processes) train in the same directory."""
    run = RunDir.new(tmp_path, "launched", "m")
    child = f"from lowmem_ft.rundir import RunDir; r = RunDir({str(run.path)!r}); r.lock(); print(r.locked)"
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # not refused, and not taken from the parent either
    run.unlock()


def _write_checkpoint(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    save_file({"lora_A": torch.ones(4, 8), "lora_B": torch.zeros(8, 4)}, path / "adapter_model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.ones(3)}}}, path / "optimizer.pt")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return path


def _cut(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - keep] if keep > 0 else data[:-1])


def test_checkpoint_problem_finds_what_a_cut_save_leaves(tmp_path):
    good = _write_checkpoint(tmp_path / "checkpoint-1", 1)
    assert checkpoint_problem(good) is None
    cases = {
        "no trainer_state.json": lambda p: (p / "trainer_state.json").unlink(),
        "adapter_model.safetensors is truncated": lambda p: _cut(p / "adapter_model.safetensors", 10),
        "optimizer.pt is truncated": lambda p: _cut(p / "optimizer.pt", 30),
        "trainer_state.json is broken": lambda p: _cut(p / "trainer_state.json", 3),
        "no weights": lambda p: (p / "adapter_model.safetensors").unlink(),
        "trainer_state.json has no global_step": lambda p: (p / "trainer_state.json").write_text("{}"),
    }
    for i, (problem, damage) in enumerate(cases.items()):
        path = _write_checkpoint(tmp_path / f"case{i}" / "checkpoint-2", 2)
        damage(path)
        assert problem in checkpoint_problem(path), problem
    assert checkpoint_problem(tmp_path / "missing") == "not a directory"


def test_last_checkpoint_is_the_newest_complete_one(tmp_path, caplog):
    """Killed during a save, `--resume` took the newest, partial checkpoint and crashed (`Can't find a valid
    checkpoint`), though a complete one existed."""
    run = RunDir.new(tmp_path, "r", "m")
    assert run.last_checkpoint() is None and run.resume_point().describe() == "no complete checkpoint"
    for step in (2, 9):
        _write_checkpoint(run.checkpoints / f"checkpoint-{step}", step)
    (run.checkpoints / "checkpoint-10").mkdir()  # what transformers' in-place save left when killed
    (run.checkpoints / "checkpoint-x").mkdir()
    (run.checkpoints / "checkpoint-11.tmp").mkdir()
    point = run.resume_point()
    assert point.checkpoint.name == "checkpoint-9" and point.step == 9
    assert [(p.name, why) for p, why in point.skipped] == [
        ("checkpoint-10", "no trainer_state.json (the save did not finish)")
    ]
    assert point.describe() == (
        "resuming from checkpoint-9 (step 9, the newest complete checkpoint); skipped checkpoint-10: no "
        "trainer_state.json (the save did not finish)"
    )
    assert run.last_checkpoint() == point.checkpoint
    assert [p.name for p in run.checkpoint_dirs()] == ["checkpoint-10", "checkpoint-9", "checkpoint-2"]
    assert run.checkpoint_size() == sum(f.stat().st_size for f in point.checkpoint.iterdir())


def test_clear_staging_removes_cut_saves_and_puts_back_a_replaced_checkpoint(tmp_path):
    run = RunDir.new(tmp_path, "r", "m")
    _write_checkpoint(run.staging / "checkpoint-3", 3).joinpath("trainer_state.json").unlink()  # cut short
    _write_checkpoint(run.staging / "replaced-checkpoint-2", 2)  # a crash between the two renames of a replace
    _write_checkpoint(run.staging / "replaced-checkpoint-1", 1)  # ... whose new checkpoint-1 did arrive
    _write_checkpoint(run.checkpoints / "checkpoint-1", 1)
    (run.path / ".adapter.partial").mkdir()
    run.clear_staging()
    assert not run.staging.exists() and not (run.path / ".adapter.partial").exists()
    assert [p.name for p in run.checkpoint_dirs()] == ["checkpoint-2", "checkpoint-1"]
    assert checkpoint_problem(run.checkpoints / "checkpoint-2") is None


def test_status_is_kept_across_run_json_writes(tmp_path):
    run = RunDir.new(tmp_path, "r", "m")
    assert run.read_status() is None and run.describe_status() == "no status recorded"
    running = RunStatus.running()
    run.write_status(running)
    run.write_info({"name": "r"})  # setup writes run.json after the status
    assert run.read_info()["name"] == "r" and run.read_status() == running
    assert run.describe_status().startswith(f"running (pid {os.getpid()} on ")  # this object holds the lock
    run.unlock()
    assert "pid" in run.describe_status() and "killed?" in run.describe_status()  # running, and nobody holds it
    failed = running.ended("failed", step=3, reason="boom", checkpoint="runs/r/checkpoints/checkpoint-2")
    run.write_status(failed)
    assert run.read_status() == failed and run.read_status().ended_at
    assert failed.describe() == "failed at step 3: boom; kept checkpoint-2"
    assert not list(run.path.glob(".*.tmp"))  # written through a temporary file, renamed


def test_a_failed_write_leaves_the_old_record(tmp_path, monkeypatch):
    run = RunDir.new(tmp_path, "r", "m")
    run.write_info({"name": "old"})

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        run.write_info({"name": "new"})
    monkeypatch.undo()
    assert run.read_info() == {"name": "old"} and not list(run.path.glob(".*.tmp"))


@pytest.mark.parametrize(
    "status,checkpoint,restart",
    [
        ("failed", False, True),
        ("interrupted", False, True),
        ("running", False, True),  # killed: its lock is free
        ("completed", False, False),
        ("failed", True, False),  # it has a checkpoint: --resume
        (None, False, False),  # no status: not ours to clear
    ],
)
def test_a_run_that_stopped_before_its_first_checkpoint_can_start_again(tmp_path, status, checkpoint, restart):
    """A run that failed before its first checkpoint left a directory that blocked a restart ("already exists …
    --resume") while `--resume` said "no checkpoint saved yet"."""
    run = RunDir.new(tmp_path, "r", "m")
    run.write_info({"name": "r"})
    (run.path / "memory.jsonl").write_text("{}\n")
    if status is not None:
        run.write_status(
            RunStatus.running().ended(status, reason="bad data") if status != "running" else RunStatus.running()
        )
    if checkpoint:
        _write_checkpoint(run.checkpoints / "checkpoint-1", 1)
    run.unlock()
    if restart:
        again = RunDir.new(tmp_path, "r", "m")
        assert [p.name for p in again.path.iterdir()] == [".lock"]
        again.unlock()
    else:
        with pytest.raises(UserError, match="already exists"):
            RunDir.new(tmp_path, "r", "m")
        assert run.info_file.is_file()


def test_trim_memory_log_drops_the_steps_a_resume_redoes(tmp_path):
    run = RunDir.new(tmp_path, "r", "m")
    records = [
        {"event": "start", "step": 0},
        {"step": 1, "phase": "forward"},
        {"step": 2, "phase": "forward"},
        {"step": 2, "phase": "save"},
        {"event": "start", "step": 2},  # a resume from step 2
        {"step": 3, "phase": "forward"},
        {"event": "oom_recovered", "step": 3},
        {"step": 4, "phase": "forward"},
    ]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "pha'  # cut by the kill
    run.memory_file().write_text(text)
    assert run.trim_memory_log(2) == 3  # two samples and the cut line
    kept = [json.loads(line) for line in run.memory_file().read_text().splitlines()]
    assert kept == records[:5] + [records[6]]  # samples and starts after step 2 gone; the event stays, as history
    assert run.trim_memory_log(2) == 0 and run.trim_memory_log(5, rank=1) == 0  # nothing to drop, no file


def test_records_read_back(tmp_path):
    run = RunDir.new(tmp_path, "r", "m")
    recipe = resolve("8gb", {"model": {"name_or_path": "m"}})
    run.write_recipe(recipe)
    assert run.read_recipe() == recipe and run.read_recipe(["training.max_steps=3"]).training.max_steps == 3
    choice = Choice("plan", "8gb", "m", Target(8, 0.75), 6.5, True, reasons={"quantization": "nf4"})
    run.write_info({"choice": choice.to_dict()})
    assert run.read_choice() == choice and run.read_info()["choice"]["budget_gb"] == 7.25
    run.write_metrics({"global_step": 2}, [{"loss": 1.0}, {"loss": 0.5}])
    assert run.log_history_file.read_text().count("\n") == 2
    assert run.memory_file(0).name == "memory.jsonl" and run.memory_file(3).name == "memory.rank3.jsonl"
    assert run.weights(full=False).name == "adapter" and run.weights(full=True).name == "model"


def test_an_existing_run_must_have_its_recipe(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        RunDir.existing(tmp_path / "nope")
    with pytest.raises(UserError, match="not a run directory"):
        RunDir.existing(tmp_path)
    with pytest.raises(UserError, match="not a prepared run"):
        RunDir(tmp_path).read_launch()
