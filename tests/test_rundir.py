"""The run directory: names stay names, every file has one owner, and records read back as written."""

from __future__ import annotations

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.memory.target import Target
from lowmem_ft.planning import Choice
from lowmem_ft.recipe.load import resolve
from lowmem_ft.rundir import RunDir


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
    with pytest.raises(UserError, match="already exists; pick another --name or continue it with --resume"):
        RunDir.new(tmp_path, run.name, "m")
    assert RunDir.new(tmp_path, "empty", "m").path == RunDir.new(tmp_path, "empty", "m").path  # empty: reused


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


def test_last_checkpoint_is_transformers_choice(tmp_path):
    run = RunDir.new(tmp_path, "r", "m")
    assert run.last_checkpoint() is None
    for step in (2, 10, 9):
        (run.checkpoints / f"checkpoint-{step}").mkdir(parents=True)
    (run.checkpoints / "checkpoint-x").mkdir()
    assert run.last_checkpoint().name == "checkpoint-10"


def test_an_existing_run_must_have_its_recipe(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        RunDir.existing(tmp_path / "nope")
    with pytest.raises(UserError, match="not a run directory"):
        RunDir.existing(tmp_path)
    with pytest.raises(UserError, match="not a prepared run"):
        RunDir(tmp_path).read_launch()
