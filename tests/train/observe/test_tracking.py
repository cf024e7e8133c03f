"""Trackers: which ones a recipe asks for, the run config they get, TensorBoard in the run directory, memory series."""

from __future__ import annotations

import importlib.util
import struct
import sys
import types

import pytest

from lowmem_ft.choosing import Choice
from lowmem_ft.errors import ConfigError, UserError
from lowmem_ft.recipe.load import resolve
from lowmem_ft.rundir import MemoryLog
from lowmem_ft.train.observe import tracking
from lowmem_ft.train.observe.tracking import RunConfig, Tracking, configure, memory_series, run_config


def test_report_to_follows_the_recipe_and_wandb_mode(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_MODE", "WANDB_PROJECT"):  # restored after the test
        monkeypatch.delenv(var, raising=False)
    both = resolve(None, ["logging.report_to=[wandb, tensorboard]", "logging.wandb_mode=offline"])
    monkeypatch.setattr(tracking, "_available", lambda name: True)
    assert configure(both, tmp_path).active == ["wandb", "tensorboard"]
    # the WANDB_MODE the first run set is not the user's: the second run's recipe decides
    off = resolve(None, ["logging.report_to=[wandb, tensorboard]", "logging.wandb_mode=disabled"])
    assert configure(off, tmp_path).active == ["tensorboard"]
    assert configure(resolve(None, ["logging.report_to=[none]"]), tmp_path).active == []
    assert Tracking("offline", ("wandb",)).enabled and not Tracking("disabled", ("wandb",)).enabled


def test_report_to_is_checked_when_the_recipe_is_read():
    with pytest.raises(ConfigError, match="'none' cannot be combined with trackers"):
        resolve(None, ["logging.report_to=[none, wandb]"])
    with pytest.raises(ConfigError, match="must be a list of wandb, tensorboard, trackio, none, got"):
        resolve(None, ["logging.report_to=[mlflow]"])


@pytest.mark.skipif(importlib.util.find_spec("trackio") is not None, reason="trackio is installed here")
def test_a_tracker_that_is_not_installed_is_one_line_before_training(tmp_path):
    with pytest.raises(UserError, match=r"logging.report_to trackio: not installed; `pip install trackio`"):
        configure(resolve(None, ["logging.report_to=[trackio]"]), tmp_path)


def test_the_run_directory_of_an_earlier_run_is_not_kept(tmp_path, monkeypatch):
    """WANDB_DIR points each run at its own directory; one the user set is theirs and stays."""
    for var in ("WANDB_DIR", "WANDB_MODE", "WANDB_PROJECT"):  # restored after the test
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tracking, "_available", lambda name: True)
    recipe = resolve(None, ["logging.wandb_mode=offline"])
    configure(recipe, tmp_path / "a")
    assert tracking.os.environ["WANDB_DIR"] == str((tmp_path / "a").resolve())
    configure(recipe, tmp_path / "b")
    assert tracking.os.environ["WANDB_DIR"] == str((tmp_path / "b").resolve())
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "mine"))
    configure(recipe, tmp_path / "c")
    assert tracking.os.environ["WANDB_DIR"] == str(tmp_path / "mine")


class RecordingWriter:
    """Stands in for a TensorBoard SummaryWriter: records `add_text` calls."""

    def __init__(self):
        self.texts: dict[str, str] = {}

    def add_text(self, tag, text):
        self.texts[tag] = text

    def flush(self):
        pass


def test_the_recipe_and_plan_go_to_tensorboard_and_trackio(monkeypatch):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    recipe = resolve("8gb", ["model.name_or_path=m"])
    config = run_config(
        recipe, Choice.from_dict({"how": "recipe", "recipe": "8gb", "vram_gb": 8, "safety_margin_gb": 1})
    )
    assert config["recipe"]["memory"]["max_seq_len"] == recipe.memory.max_seq_len
    assert config["plan"]["budget_gb"] == 7 and config["plan"]["how"] == "recipe"
    tensorboard = types.SimpleNamespace(tb_writer=RecordingWriter())
    updates: list[dict] = []
    fake_trackio = types.SimpleNamespace(config=types.SimpleNamespace(update=lambda d, **kw: updates.append(d)))
    monkeypatch.setitem(sys.modules, "trackio", fake_trackio)
    callback = RunConfig(Tracking("disabled", ("tensorboard", "trackio")), config, {}, tensorboard)
    callback.on_train_begin(TrainingArguments("out", report_to=[]), TrainerState(), TrainerControl())
    assert set(tensorboard.tb_writer.texts) == {"lowmem_ft/recipe", "lowmem_ft/plan"}
    assert '"max_seq_len": ' + str(recipe.memory.max_seq_len) in tensorboard.tb_writer.texts["lowmem_ft/recipe"]
    assert updates == [config]


def _events(path):
    """(tag, text or value) of a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
    try:
        from tensorboard.compat.proto import event_pb2
    except ImportError:
        from tensorboardX.proto import event_pb2
    data, pos = path.read_bytes(), 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
        for v in event.summary.value:
            yield v.tag, (v.tensor.string_val[0].decode() if v.tensor.string_val else v.simple_value)


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None,
    reason="neither tensorboard nor tensorboardX is installed",
)
def test_a_tensorboard_run_writes_its_events_with_recipe_and_plan_into_the_run_directory(tiny_model, tmp_path):
    from tests.train.tiny_runs import tiny_run

    result = tiny_run(tiny_model, "examples/chat.jsonl", tmp_path, "tb", "logging.report_to=[tensorboard]")
    (events,) = (result.run_dir / "tensorboard").glob("events.*")
    tags = dict(_events(events))
    assert '"max_seq_len": 48' in tags["lowmem_ft/recipe/text_summary"]
    assert '"budget_gb": 7' in tags["lowmem_ft/plan/text_summary"]
    assert "train/loss" in tags
    assert not (result.run_dir / "wandb").exists()


def test_memory_series_per_phase_with_budget_and_prediction():
    start = {"event": "start", "budget_gb": 7.0, "predicted_peak_gb": 5.5}
    cpu = [{"step": 1, "phase": "forward", "rss_gb": 1.0}, {"step": 1, "phase": "forward", "rss_gb": 1.2},
           {"step": 1, "phase": "backward", "rss_gb": 1.1}, {"step": 2, "phase": "forward", "rss_gb": 1.3}]  # fmt: skip
    series = memory_series(MemoryLog(start=start, samples=cpu))
    assert series["forward (host RSS)"] == [(1, 1.2), (2, 1.3)]  # the step's highest sample of the phase
    assert series["backward (host RSS)"] == [(1, 1.1)]
    assert series["budget (GPU)"] == [(1, 7.0), (2, 7.0)] and series["predicted peak (GPU)"] == [(1, 5.5), (2, 5.5)]
    cuda = [{"step": 1, "phase": "optimizer", "peak_gb": 4.0, "rss_gb": 2.0}]
    assert memory_series(MemoryLog(start=start, samples=cuda)) == {
        "optimizer (peak)": [(1, 4.0)], "budget": [(1, 7.0), (1, 7.0)], "predicted peak": [(1, 5.5), (1, 5.5)]
    }  # fmt: skip


@pytest.mark.slow
def test_wandb_online_without_its_server_falls_back_to_offline_once(tiny_model, tmp_path, monkeypatch, caplog):
    """Issue #24: W&B online with no route to its server. wandb.init retried for its init_timeout (90 s) and then
    raised CommError out of the trainer: the run failed with a traceback. It trains, says once what it fell back to,
    and keeps the offline run in the run directory for `wandb sync`."""
    import logging

    from tests.train.tiny_runs import tiny_run

    for var in ("WANDB_DIR", "WANDB_MODE", "WANDB_PROJECT"):  # restored after the test
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)  # logged in …
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # … to a server nothing answers for
    monkeypatch.setattr(tracking, "_SET_BY_US", {})
    with caplog.at_level(logging.WARNING):
        result = tiny_run(tiny_model, "examples/chat.jsonl", tmp_path, "wb", "training.max_steps=2",
                          "logging.report_to=[wandb]", "logging.wandb_mode=online")  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("W&B: cannot reach http://127.0.0.1:9 (")
    assert "logging offline" in said[0] and f"wandb sync {result.run_dir / 'wandb'}" in said[0]
    assert result.metrics["global_step"] == 2 and result.metrics["wandb_mode"] == "offline"
    assert list((result.run_dir / "wandb").glob("offline-run-*"))


def test_wandb_is_quiet_at_the_end_of_a_run_unless_asked(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("WANDB_QUIET", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # `train --no-wandb` earlier in this process set it to disabled
    monkeypatch.setattr(tracking, "_SET_BY_US", {})
    tracking.configure(resolve("8gb", ["logging.wandb_mode=offline"]), tmp_path)
    assert os.environ["WANDB_QUIET"] == "true"  # no history / summary footer (everything is still logged)
    monkeypatch.setenv("WANDB_QUIET", "false")
    tracking.configure(resolve("8gb", ["logging.wandb_mode=offline"]), tmp_path)
    assert os.environ["WANDB_QUIET"] == "false"  # the user's word wins
