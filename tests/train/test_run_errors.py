"""`FineTune.fit` ends with the memory report in a `finally`: the report must never replace why fit ended."""

from __future__ import annotations

import pytest
from transformers import TrainerCallback

from tests.train.tiny_runs import tiny_trainer


class FailAtStart(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        raise ValueError("the real cause")


def test_a_failing_report_does_not_mask_the_exception_fit_ends_with(tiny_model, chat_data, tmp_path, monkeypatch):
    import lowmem_ft.report

    def broken_report(run_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lowmem_ft.report, "write_report", broken_report)
    job = tiny_trainer(tiny_model, chat_data, tmp_path)
    job.trainer.add_callback(FailAtStart())
    with pytest.raises(ValueError, match="the real cause"):
        job.fit()


def test_no_memory_log_means_no_report_and_no_error(tiny_model, chat_data, tmp_path, capsys):
    """Issue #16: `optimizer.lr: -0.01` failed before the first step and surfaced as FileNotFoundError for
    memory.jsonl, raised by the report in fit's `finally`."""
    job = tiny_trainer(tiny_model, chat_data, tmp_path)
    assert not job.run.memory_file().exists()
    job._report()
    assert "memory:" not in capsys.readouterr().out
