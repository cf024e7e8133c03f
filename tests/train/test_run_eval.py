"""Evaluation during training: held-out split, eval loss + perplexity at the cadence, best checkpoint kept."""

from __future__ import annotations

import json
import math

import pytest

from lowmem_ft.cli import main
from lowmem_ft.data.prepare import held_out_split
from lowmem_ft.train.resilience.trainer import add_perplexity


def test_held_out_split_is_seeded_and_disjoint():
    train, held = held_out_split(40, 0.25, seed=7)
    assert len(held) == 10 and len(train) == 30
    assert sorted(train + held) == list(range(40))
    assert train == sorted(train) and held == sorted(held)  # both keep the file's order
    assert held_out_split(40, 0.25, seed=7) == (train, held)
    assert held_out_split(40, 0.25, seed=8)[1] != held
    # not simply the file's tail: data files are often sorted
    assert held != list(range(30, 40))


def test_held_out_split_refuses_to_leave_nothing_to_train():
    from lowmem_ft.errors import UserError

    with pytest.raises(UserError, match="nothing to train on"):
        held_out_split(1, 0.5, seed=0)


def test_perplexity_is_exp_of_eval_loss():
    logs = {"eval_loss": 2.0, "loss": 5.0}
    add_perplexity(logs)
    assert logs["eval_perplexity"] == pytest.approx(math.exp(2.0))
    train_only = {"loss": 1.0}
    add_perplexity(train_only)
    assert "eval_perplexity" not in train_only


@pytest.mark.slow
def test_train_with_held_out_eval_keeps_best_checkpoint(tiny_model, chat_data, tmp_path):
    rc = main(
        [
            "train",
            "--vram", "8",
            "--model", tiny_model,
            "--data", chat_data,
            "--name", "ev",
            "--no-wandb",
            "--set", f"training.output_dir={tmp_path}",
            "--set", "data.eval_fraction=0.25",
            "--set", "training.max_steps=4",
            "--set", "training.eval_steps=2",
            "--set", "training.save_steps=3",
            "--set", "memory.eval_batch_size=3",
            "--set", "optimizer.lr=0.005",
            "--set", "memory.gradient_accumulation=2",
            "--set", "memory.micro_batch_size=1",  # both fixed: 2 samples per step
        ]
    )  # fmt: skip
    assert rc == 0
    run_dir = tmp_path / "ev"
    info = json.loads((run_dir / "run.json").read_text())
    assert info["data"]["eval_records"] == 24 and info["data"]["train_records"] == 72
    assert "seed 42" in info["data"]["eval_source"]
    # saves follow the eval cadence so that every candidate for best exists on disk
    assert info["eval"] == {
        "records": 24,
        "batch_size": 3,
        "batch_size_from": "3 (set by you)",
        "eval_steps": 2,
        "save_steps": 2,
        "best_by": "eval_loss",
    }

    history = [json.loads(line) for line in (run_dir / "log_history.jsonl").read_text().splitlines()]
    evals = [h for h in history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [2, 4]
    for h in evals:
        assert h["eval_perplexity"] == pytest.approx(math.exp(h["eval_loss"]))

    metrics = json.loads((run_dir / "metrics.json").read_text())
    best = min(evals, key=lambda h: h["eval_loss"])
    assert metrics["best_eval_loss"] == best["eval_loss"]
    assert metrics["best_step"] == best["step"]
    assert metrics["best_checkpoint"].endswith(f"checkpoint-{best['step']}")
    assert metrics["last_eval_perplexity"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))

    # adapter/ holds the best checkpoint's weights (load_best_model_at_end), not necessarily the last step's
    from safetensors.torch import load_file

    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    best_weights = load_file(f"{metrics['best_checkpoint']}/adapter_model.safetensors")
    assert saved.keys() == best_weights.keys()
    for key in saved:
        assert saved[key].equal(best_weights[key]), key
