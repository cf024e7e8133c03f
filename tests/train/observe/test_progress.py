"""The progress bar's memory postfix, from the monitor's samples; no bar under --quiet."""

from __future__ import annotations

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from lowmem_ft.memory.target import Target
from lowmem_ft.train.observe.monitor import MemoryMonitor
from lowmem_ft.train.observe.progress import MemoryProgress, memory_postfix


def test_postfix_is_device_memory_against_the_budget_or_host_memory():
    cuda = {"reserved_gb": 5.0, "peak_gb": 5.2, "device_used_gb": 5.6, "rss_gb": 3.0}
    # held = max(reserved, peak) + what NVML sees beyond reserved: 5.2 + 0.6 (monitor.used_gb)
    assert memory_postfix(cuda, Target(24, 1.0)) == "mem 5.80/23.00 GB"
    assert memory_postfix(cuda, None) == "mem 5.80 GB"
    assert memory_postfix({"rss_gb": 0.7512}, Target(8, 1.0)) == "host 0.75 GB"


def test_the_bar_shows_the_steps_highest_sample(tmp_path):
    figures = iter([{"reserved_gb": 4.0}, {"reserved_gb": 6.5}, {"reserved_gb": 5.0}, {"reserved_gb": 3.0}])
    monitor = MemoryMonitor(tmp_path / "memory.jsonl", reader=lambda: next(figures), write=False)
    progress = MemoryProgress(monitor, Target(24, 1.0))
    args, state, control = TrainingArguments(str(tmp_path), report_to=[]), TrainerState(max_steps=2), TrainerControl()
    progress.on_train_begin(args, state, control)
    for phase in ("forward", "backward", "optimizer"):
        monitor.sample(phase)
    state.global_step = 1
    progress.on_step_end(args, state, control)
    assert progress.training_bar.postfix == "mem 6.50/23.00 GB" and progress.training_bar.n == 1
    monitor.sample("forward")  # the next step starts afresh
    state.global_step = 2
    progress.on_step_end(args, state, control)
    assert progress.training_bar.postfix == "mem 3.00/23.00 GB"
    progress.on_train_end(args, state, control)


def _bars(trainer) -> list[type]:
    return [type(c) for c in trainer.callback_handler.callbacks if isinstance(c, (ProgressCallback, PrinterCallback))]


def test_the_trainer_gets_the_memory_bar_and_none_under_quiet(tiny_model, tmp_path, monkeypatch):
    from lowmem_ft import console
    from tests.train.tiny_runs import tiny_trainer

    monkeypatch.setenv(console.QUIET_ENV, "")
    job = tiny_trainer(tiny_model, "examples/chat.jsonl", tmp_path / "normal")
    assert _bars(job.trainer) == [MemoryProgress]
    monkeypatch.setenv(console.QUIET_ENV, "1")
    job = tiny_trainer(tiny_model, "examples/chat.jsonl", tmp_path / "quiet")
    assert _bars(job.trainer) == []


# -- the compact line per log ---------------------------------------------------------------------------------------
def test_a_logging_step_is_one_compact_line():
    from lowmem_ft.train.observe.progress import eval_line, train_line

    logs = {"loss": 6.2244, "grad_norm": 0.6986, "learning_rate": 2e-4, "entropy": 6.2, "mean_token_accuracy": 0.125,
            "num_tokens": 506.0, "epoch": 0.17}  # fmt: skip
    line = train_line(logs, 10, 100, tokens_per_s=1234.4, memory="mem 5.21/7.25 GB")
    assert line == "step 10/100  loss 6.2244  lr 2.00e-04  grad 0.699  1,234 tok/s  mem 5.21/7.25 GB  acc 0.125"
    # a preference method passes its own metrics; absent ones are left out
    dpo = {"loss": 0.69, "rewards/margins": 0.0312, "rewards/accuracies": 0.5}
    shown = {"rewards/margins": "margin", "rewards/accuracies": "acc", "missing": "x"}
    assert train_line(dpo, 3, -1, shown=shown) == "step 3  loss 0.6900  margin 0.0312  acc 0.5"
    assert eval_line({"eval_loss": 1.2345, "eval_perplexity": 3.4366, "eval_runtime": 12.34}, 50) == (
        "eval at step 50  loss 1.2345  ppl 3.437  12.3 s"
    )


def test_the_bar_writes_lines_with_tokens_per_second_and_the_memory_since_the_last(tmp_path, monkeypatch):
    from lowmem_ft.train.observe import progress

    figures = iter([{"reserved_gb": 4.0}, {"reserved_gb": 6.5}, {"reserved_gb": 5.0}])
    monitor = MemoryMonitor(tmp_path / "memory.jsonl", reader=lambda: next(figures), write=False)
    bar = MemoryProgress(monitor, Target(8, 0.75))
    args, state, control = TrainingArguments(str(tmp_path), report_to=[]), TrainerState(max_steps=20), TrainerControl()
    clock = iter([100.0, 102.0, 104.0])
    monkeypatch.setattr(progress.time, "time", lambda: next(clock))
    bar.on_train_begin(args, state, control)
    monitor.sample("forward")
    monitor.sample("backward")
    state.global_step = 1
    bar.on_log(args, state, control, logs={"loss": 2.0, "learning_rate": 1e-4, "grad_norm": 1.0, "num_tokens": 1000.0})
    monitor.sample("forward")
    state.global_step = 2
    bar.on_log(args, state, control, logs={"loss": 1.5, "learning_rate": 1e-4, "grad_norm": 0.5, "num_tokens": 3000.0})
    bar.on_log(args, state, control, logs={"train_runtime": 4.0, "train_loss": 1.7})  # the done line says it
    assert bar.lines == [
        "step 1/20  loss 2.0000  lr 1.00e-04  grad 1  500 tok/s  mem 6.50/7.25 GB",
        "step 2/20  loss 1.5000  lr 1.00e-04  grad 0.5  1,000 tok/s  mem 5.00/7.25 GB",
    ]
    bar.on_train_end(args, state, control)
    assert progress.tokens_per_second({"train_runtime": 4.0}, [{"num_tokens": 3000.0}, {"train_loss": 1.7}]) == 750


def test_the_trainer_does_not_prepare_prepared_data_again(tiny_model, tmp_path, monkeypatch):
    """TRL's second pass ("Truncating train dataset", "Dropping fully masked examples", packing) is skipped: our data
    is fitted and labelled already, and packed rows are packed by lowmem_ft.data.prepare.pack."""
    from trl import SFTTrainer

    from tests.train.tiny_runs import tiny_trainer

    def again(*args, **kwargs):
        raise AssertionError("TRL prepared the data again")

    monkeypatch.setattr(SFTTrainer, "_prepare_dataset", again)
    plain = tiny_trainer(tiny_model, "examples/chat.jsonl", tmp_path / "plain", "memory.max_seq_len=256")
    assert plain.trainer._skip_prepare_dataset and "seq_lengths" not in plain.trainer.train_dataset.column_names
    packed = tiny_trainer(tiny_model, "examples/chat.jsonl", tmp_path / "packed", "memory.max_seq_len=256",
                          "data.packing=true")  # fmt: skip
    rows = packed.trainer.train_dataset
    assert packed.trainer.padding_free and "seq_lengths" in rows.column_names
    assert len(rows) < len(plain.trainer.train_dataset)  # several samples per row
    assert sum(map(sum, rows["seq_lengths"])) == sum(map(len, plain.trainer.train_dataset["input_ids"]))
