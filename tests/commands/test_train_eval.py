"""`train --eval-tasks`: the finished run evaluated by the same `eval` command, its scores in eval.json."""

from __future__ import annotations

import json

import pytest

from lowmem_ft.cli import main
from tests.evaluate.test_eval import task_file  # noqa: F401 (the fixture)


@pytest.mark.slow
def test_train_then_eval(tiny_model, chat_data, task_file, tmp_path, capsys):  # noqa: F811
    argv = ["train", "--vram", "8", "--model", tiny_model, "--data", chat_data, "--name", "e", "--no-wandb",
            "--set", "training.max_steps=2", "--set", f"training.output_dir={tmp_path}",
            "--eval-tasks", str(task_file), "--eval-limit", "4", "--eval-compare-base"]  # fmt: skip
    assert main(argv) == 0
    record = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert record["tasks"] == ["tiny_qa"] and record["limit"] == 4
    assert set(record["finetuned"]["tiny_qa"]) >= {"acc", "acc_norm"} and "delta" in record
    assert "fine-tuned" in capsys.readouterr().out


def test_eval_flags_without_tasks_are_one_line(tiny_model, chat_data, tmp_path, capsys):
    argv = ["train", "--model", tiny_model, "--data", chat_data, "--eval-limit", "4",
            "--set", f"training.output_dir={tmp_path}"]  # fmt: skip
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().endswith("--eval-limit / --eval-compare-base need --eval-tasks")
    assert not list(tmp_path.iterdir())


def test_unknown_eval_task_stops_before_training(tiny_model, chat_data, tmp_path, capsys):
    argv = ["train", "--model", tiny_model, "--data", chat_data, "--eval-tasks", str(tmp_path / "nope.yaml"),
            "--set", f"training.output_dir={tmp_path / 'runs'}"]  # fmt: skip
    assert main(argv) == 2
    assert "--tasks " in capsys.readouterr().err and not (tmp_path / "runs").exists()
