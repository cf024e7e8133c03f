"""SIGINT / SIGTERM / SIGHUP: the step in progress finishes, a checkpoint is saved, the run says how to resume and exits
130 / 143; a second Ctrl-C aborts at once; a signal before training stops at once; the ranks stop together."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback, TrainerControl

from lowmem_ft import cli
from lowmem_ft.rundir import RunDir, checkpoint_problem
from lowmem_ft.train import run as run_module
from lowmem_ft.train.resilience import interrupt
from tests.train.tiny_runs import tiny_run, tiny_sets

pytestmark = pytest.mark.slow
DATA = "tests/data/numbered.jsonl"
STEPS = 4
ADAPTER = "adapter/adapter_model.safetensors"
SHIPPED = ("adapter.dropout=0.05", f"training.max_steps={STEPS}")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory) -> Path:
    return tiny_run(tiny_model, DATA, tmp_path_factory.mktemp("runs"), "baseline", *SHIPPED).run_dir


class SendAt(TrainerCallback):
    """Send this process `signals` at the start of optimizer step `step` (or at the end of training: step 0)."""

    def __init__(self, step: int, *signals: int):
        self.step, self.signals = step, signals

    def _send(self):
        for signum in self.signals:
            os.kill(os.getpid(), signum)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self._send()

    def on_train_end(self, args, state, control, **kwargs):
        if self.step == 0:
            self._send()


def train_cli(tiny_model, out: Path, name: str, monkeypatch, *callbacks, extra=()) -> int:
    """`lowmem-ft train` in this process, with `callbacks` given to the trainer."""
    train = run_module.train
    monkeypatch.setattr(run_module, "train", lambda *a, **k: train(*a, **{**k, "callbacks": list(callbacks)}))
    argv = ["train", "--recipe", "8gb", "--name", name, "--no-wandb"]
    for item in tiny_sets(tiny_model, DATA, out, *SHIPPED, *extra):
        argv += ["--set", item]
    return cli.main(argv)


def error_line(capsys) -> str:
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "lowmem-ft train: error: " in x]
    return line.partition("lowmem-ft train: error: ")[2]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "log_history.jsonl").read_text().splitlines()) if "loss" in r]


def assert_same_adapter(run: Path, baseline: Path) -> None:
    a, b = load_file(run / ADAPTER), load_file(baseline / ADAPTER)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_finishes_the_step_saves_and_resume_is_exact(tiny_model, tmp_path, baseline, monkeypatch, capsys):
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert train_cli(tiny_model, tmp_path, "term", monkeypatch, SendAt(2, signal.SIGTERM)) == 143
    run = tmp_path / "term"
    line = error_line(capsys)
    assert line == (
        f"interrupted by SIGTERM: stopped after step 2; kept {run}/checkpoints/checkpoint-2 (step 2); continue with: "
        f"lowmem-ft train --resume {run}"
    )
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # put back
    status = RunDir(run).read_status()
    assert (status.state, status.step, status.signal, status.reason) == ("interrupted", 2, "SIGTERM", line)
    assert checkpoint_problem(run / "checkpoints" / "checkpoint-2") is None  # saved after step 2, not before it
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["interrupted"] == "SIGTERM" and metrics["stopped_after_step"] == 2 and len(losses(run)) == 2
    assert metrics["train_loss"] == pytest.approx(sum(losses(run)) / 2, rel=1e-6)
    assert not (run / "adapter").exists() and not RunDir(run).in_use()

    monkeypatch.undo()
    assert cli.main(["train", "--resume", str(run), "--no-wandb"]) == 0
    assert RunDir(run).read_status().state == "completed"
    assert losses(run) == losses(baseline)
    assert_same_adapter(run, baseline)
    # metrics.json describes the whole run, not the resumed steps alone (issue #24: train_loss covered steps 3-4)
    resumed, whole = (json.loads((r / "metrics.json").read_text()) for r in (run, baseline))
    assert resumed["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-6)
    assert resumed["train_loss"] == pytest.approx(sum(losses(baseline)) / STEPS, rel=1e-6)
    assert resumed["train_loss_steps"] == whole["train_loss_steps"] == resumed["global_step"] == STEPS
    assert resumed["first_loss"] == whole["first_loss"] and resumed["last_loss"] == whole["last_loss"]


def test_sighup_is_answered_like_sigterm(tiny_model, tmp_path, baseline, monkeypatch, capsys):
    """Issue 32: a closed terminal or SSH session (SIGHUP) killed the run at once — no checkpoint, run.json left
    `running`. Now: the step finishes, a checkpoint is saved, `interrupted` with exit 129, and resume is exact."""
    handler = signal.getsignal(signal.SIGHUP)
    assert train_cli(tiny_model, tmp_path, "hup", monkeypatch, SendAt(2, signal.SIGHUP)) == 129
    run = tmp_path / "hup"
    line = error_line(capsys)
    assert line.startswith("interrupted by SIGHUP: stopped after step 2; kept ") and f"--resume {run}" in line
    assert signal.getsignal(signal.SIGHUP) == handler  # put back
    status = RunDir(run).read_status()
    assert (status.state, status.step, status.signal) == ("interrupted", 2, "SIGHUP")
    assert checkpoint_problem(run / "checkpoints" / "checkpoint-2") is None
    monkeypatch.undo()
    assert cli.main(["train", "--resume", str(run), "--no-wandb"]) == 0
    assert losses(run) == losses(baseline)
    assert_same_adapter(run, baseline)


def test_an_interrupt_in_the_second_epoch_resumes_exactly(tiny_model, tmp_path, monkeypatch, capsys):
    """64 samples, 8 per step: step 10 is in the second epoch, whose batch order transformers' length-grouped
    sampler drew from the global RNG — the resumed run saw other batches (1.7e-2 apart in the adapter) until the
    order was seeded by epoch (lowmem_ft.train.resilience.order.HeaviestFirstSampler)."""
    steps = "training.max_steps=12"
    baseline = tiny_run(tiny_model, DATA, tmp_path / "base", "base", *SHIPPED, steps).run_dir
    code = train_cli(tiny_model, tmp_path, "epoch2", monkeypatch, SendAt(10, signal.SIGTERM), extra=[steps])
    assert code == 143 and "stopped after step 10" in error_line(capsys)
    monkeypatch.undo()
    assert cli.main(["train", "--resume", str(tmp_path / "epoch2"), "--no-wandb"]) == 0
    assert losses(tmp_path / "epoch2") == losses(baseline) and len(losses(baseline)) == 12
    assert_same_adapter(tmp_path / "epoch2", baseline)


def test_a_second_ctrl_c_aborts_at_once(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(interrupt, "REPEAT_S", 0.0)  # the second signal counts as a second Ctrl-C however soon
    code = train_cli(
        tiny_model,
        tmp_path,
        "abort",
        monkeypatch,
        SendAt(3, signal.SIGINT, signal.SIGINT),
        extra=["training.save_steps=1"],
    )
    assert code == 130
    run = tmp_path / "abort"
    assert error_line(capsys) == (
        f"aborted by a second SIGINT during step 3; kept {run}/checkpoints/checkpoint-2 (step 2); continue with: "
        f"lowmem-ft train --resume {run}"
    )
    status = RunDir(run).read_status()
    assert status.state == "interrupted" and status.step == 2 and status.signal == "SIGINT"
    assert RunDir(run).last_checkpoint().name == "checkpoint-2"


def test_one_ctrl_c_delivered_twice_is_one(tiny_model, tmp_path, monkeypatch, capsys):
    """A terminal's Ctrl-C reaches a rank of `train --gpus` from the terminal and again from torchrun."""
    assert train_cli(tiny_model, tmp_path, "twice", monkeypatch, SendAt(2, signal.SIGINT, signal.SIGINT)) == 130
    assert error_line(capsys).startswith("interrupted by SIGINT: stopped after step 2; kept ")


def test_a_signal_before_training_stops_at_once_and_the_run_can_start_again(tiny_model, tmp_path, monkeypatch, capsys):
    from lowmem_ft.train import model

    build = model.build_model

    def interrupted_build(recipe):
        os.kill(os.getpid(), signal.SIGINT)
        return build(recipe)

    monkeypatch.setattr(model, "build_model", interrupted_build)
    assert train_cli(tiny_model, tmp_path, "early", monkeypatch) == 130
    run = tmp_path / "early"
    assert error_line(capsys) == (
        "interrupted by SIGINT before training started; no checkpoint kept; start the run again with the same command "
        f"(it reuses {run})"
    )
    assert RunDir(run).read_status().state == "interrupted"
    monkeypatch.undo()
    assert train_cli(tiny_model, tmp_path, "early", monkeypatch) == 0  # the same command: the directory is reused
    assert RunDir(run).read_status().state == "completed"


def test_a_signal_during_the_final_save_lets_the_run_finish(tiny_model, tmp_path, monkeypatch, capsys):
    assert train_cli(tiny_model, tmp_path, "late", monkeypatch, SendAt(0, signal.SIGTERM)) == 0
    assert "lowmem-ft: SIGTERM: finishing the final save" in capsys.readouterr().err
    run = tmp_path / "late"
    assert RunDir(run).read_status().state == "completed" and (run / ADAPTER).is_file()


def _rank(rank: int, init: str, results: str) -> None:
    """One of two gloo ranks: only rank 1 got the signal; both must stop after the same step, on its signal."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    stop = interrupt.StopOnSignal()
    stop.phase = "training"
    args = type("Args", (), {"device": torch.device("cpu")})()
    state = type("State", (), {"global_step": 3, "max_steps": 10})()
    outcomes = []
    for received in (None, signal.SIGTERM if rank == 1 else None):
        stop.received = received
        control = TrainerControl()
        stop.on_step_end(args, state, control)
        outcomes.append((control.should_save, control.should_training_stop, stop.stopped_by, stop.stopped_at))
    Path(results, f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


def test_the_ranks_stop_after_the_same_step(tmp_path):
    import torch.multiprocessing as mp

    # forked: this process has imported everything already (spawned, each rank took ~25 s to import it again)
    mp.start_processes(_rank, args=(f"file://{tmp_path / 'init'}", str(tmp_path)), nprocs=2, start_method="fork")
    for rank in (0, 1):
        outcomes = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcomes == [[False, False, None, None], [True, True, signal.SIGTERM, 3]], rank
