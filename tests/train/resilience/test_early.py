"""After step 1 the evaluation's heaviest batch runs and a trial checkpoint is saved and removed: what they cost is
recorded, they change no loss, an eval OOM there steps the eval batch down, and a full disk ends the run at step 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lowmem_ft.train.resilience import early
from tests.train.tiny_runs import FaultInjector, memory_records, tiny_run

pytestmark = pytest.mark.slow
DATA = "tests/data/numbered.jsonl"
EVAL = ("data.eval_fraction=0.25", "training.eval_steps=2", "training.save_steps=2", "training.max_steps=3")


def _history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log_history.jsonl").read_text().splitlines()]


def test_the_eval_and_the_save_are_shown_at_step_1_and_change_nothing(tiny_model, tmp_path, monkeypatch):
    checked = tiny_run(tiny_model, DATA, tmp_path, "checked", *EVAL)
    costs = checked.metrics["early_checks"]
    assert costs["eval"]["samples"] == 4 and costs["eval"]["tokens"] > 0 and costs["eval"]["seconds"] >= 0
    assert costs["save"]["seconds"] >= 0 and costs["save"]["bytes"] > 0
    run = checked.run_dir
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-3"]  # no trial left
    phases = [(r["step"], r["phase"]) for r in memory_records(run) if "phase" in r]
    first_eval = phases.index(next(p for p in phases if p[1] == "eval_forward"))
    assert phases[first_eval][0] <= 2 and ("save" in [p[1] for p in phases[: first_eval + 3]])

    monkeypatch.setattr(early.ProveEarly, "on_step_end", lambda *a, **k: None)
    plain = tiny_run(tiny_model, DATA, tmp_path, "plain", *EVAL)
    assert plain.metrics["early_checks"] == {}

    def figures(run):
        return [(h.get("loss"), h.get("eval_loss"), h.get("grad_norm")) for h in _history(run) if "step" in h]

    assert figures(run) == figures(plain.run_dir)  # the same losses, eval losses and gradients


def test_an_eval_oom_at_step_1_steps_the_eval_batch_down_there(tiny_model, tmp_path):
    """The eval forward of 4 rows runs out of memory once, during the check after step 1: the guard halves the eval
    batch then, and the real evaluation at step 2 runs at 2."""
    injected = []

    def fail(step, rows, training):
        if not training and rows == 4 and not injected:
            injected.append(step)
            return True
        return False

    result = tiny_run(tiny_model, DATA, tmp_path, "evaloom", *EVAL, callbacks=[FaultInjector(fail)])
    assert injected == [2]  # during step 1's check (the hook counts the step in progress)
    assert result.metrics["early_checks"]["eval"]["samples"] == 2
    events = [r for r in memory_records(result.run_dir) if r.get("event")]
    assert any("eval" in json.dumps(e) and "4 → 2" in json.dumps(e, ensure_ascii=False) for e in events), events


def test_a_disk_too_small_for_a_checkpoint_ends_the_run_at_step_1(tiny_model, tmp_path, monkeypatch, capsys):
    from lowmem_ft import cli
    from lowmem_ft.train.resilience import checkpoints
    from tests.train.tiny_runs import tiny_sets

    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: 1000)
    argv = ["train", "--recipe", "8gb", "--name", "full", "--no-wandb"]
    for item in tiny_sets(tiny_model, DATA, tmp_path, "training.save_steps=50", "training.max_steps=100"):
        argv += ["--set", item]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "disk full while saving checkpoint-1" in err and "Traceback" not in err
    status = json.loads((tmp_path / "full" / "run.json").read_text())["status"]
    assert status["state"] == "failed" and status["step"] == 1
    assert not (tmp_path / "full" / "checkpoints" / ".staging").exists() or not any(
        (tmp_path / "full" / "checkpoints" / ".staging").iterdir()
    )
    shutil.rmtree(tmp_path / "full")
