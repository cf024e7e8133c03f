"""A launch fails as one (issue #24): `train --gpus 2` (two CPU gloo ranks through accelerate launch) where one rank
is killed, hangs, or raises, or where the launching process alone is interrupted. Every rank stops within a bounded
time, run.json says `failed` / `interrupted` with the reason and the rank, the last complete checkpoint is kept, and
`--resume` reaches the losses and the adapter of a launch that was never stopped.

The faults are injected by tests/train/faulty_rank.py, which the ranks run in place of `lowmem_ft` (no hook in the
package), at step 3 of 4 on rank 1, after checkpoint-2 (a checkpoint after each step). The runs are the smallest
the suite has: the tiny model, 4 steps of 2 × (4 × 2) samples, 48 tokens.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lowmem_ft.cli import main
from lowmem_ft.rundir import RunDir, checkpoint_problem
from lowmem_ft.train.distributed import launch
from tests.train.tiny_runs import tiny_sets

pytestmark = pytest.mark.slow
DATA = "tests/data/numbered.jsonl"
STEPS = 4
ADAPTER = "adapter/adapter_model.safetensors"
TIMEOUT_S = 30  # training.rank_timeout_s of these runs: how long the others wait for a hung rank


def argv(model: str, out: Path, name: str) -> list[str]:
    args = ["train", "--recipe", "8gb", "--gpus", "2", "--name", name, "--no-wandb"]
    sets = tiny_sets(model, DATA, out, f"training.max_steps={STEPS}", "training.save_steps=1",
                     f"training.rank_timeout_s={TIMEOUT_S}")  # fmt: skip
    for item in sets:
        args += ["--set", item]
    return args


@pytest.fixture
def faulty(monkeypatch):
    """Make the ranks of the next launch run tests.train.faulty_rank with FAULT at step 3 on rank 1."""

    def arm(fault: str) -> None:
        monkeypatch.setenv("FAULT", fault)
        monkeypatch.setenv("FAULTY_RANK", "1")
        monkeypatch.setenv("FAULTY_STEP", "3")
        run = launch.run

        def entry(cmd):
            at = cmd.index("-m")
            return run([*cmd[: at + 1], "tests.train.faulty_rank", *cmd[at + 2 :]])

        monkeypatch.setattr(launch, "run", entry)

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return arm


def losses(run: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (run / "log_history.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory) -> Path:
    """The uninterrupted launch every drill's resumed run must reach."""
    out = tmp_path_factory.mktemp("launch")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    assert main(argv(tiny_model, out, "baseline")) == 0
    print(f"baseline launch: {time.monotonic() - started:.0f} s")
    return out / "baseline"


def the_error(capfd) -> tuple[str, str]:
    """The launcher's one line (the ranks print their own above it) and all the output."""
    captured = capfd.readouterr()
    text = captured.out + captured.err
    lines = [x for x in captured.err.splitlines() if x.startswith("lowmem-ft train: error: ")]
    assert lines, text[-3000:]
    return lines[-1].removeprefix("lowmem-ft train: error: "), text


def resume_to_the_baseline(run: Path, baseline: Path, monkeypatch) -> None:
    monkeypatch.undo()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["train", "--resume", str(run), "--gpus", "2", "--no-wandb"]) == 0
    assert losses(run) == losses(baseline) and len(losses(run)) == STEPS
    a, b = load_file(run / ADAPTER), load_file(baseline / ADAPTER)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert RunDir(run).read_status().state == "completed"


def assert_kept_checkpoint_2(run: Path) -> None:
    kept = RunDir(run).last_checkpoint()
    assert kept is not None and kept.name == "checkpoint-2" and checkpoint_problem(kept) is None
    assert sorted(p.name for p in kept.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]


@pytest.mark.parametrize(
    "fault,expected",
    [
        ("kill", "rank 1 ended without a word (killed, or out of host memory)"),
        ("error", "rank 1 failed during step 3: ValueError: a bad sample in rank 1's shard"),
        ("hang", f"rank 1 stopped responding: the other ranks waited {TIMEOUT_S} s for it at a collective"),
    ],
)
def test_one_rank_ends_the_launch(tiny_model, tmp_path, baseline, faulty, monkeypatch, capfd, fault, expected):
    faulty(fault)
    started = time.monotonic()
    assert main(argv(tiny_model, tmp_path, fault)) == 2
    took = time.monotonic() - started
    run = tmp_path / fault
    line, text = the_error(capfd)
    assert line.startswith(expected), line
    assert line.endswith(f"kept {run}/checkpoints/checkpoint-2 (step 2); continue with: lowmem-ft train --resume {run}")
    status = RunDir(run).read_status()
    assert (status.state, status.rank, status.reason) == ("failed", 1, line)
    assert_kept_checkpoint_2(run)
    assert "Traceback" not in line
    print(f"{fault}: the launch ended in {took:.0f} s")
    resume_to_the_baseline(run, baseline, monkeypatch)


def test_interrupting_the_launcher_alone_stops_every_rank(tiny_model, tmp_path, baseline, capfd, monkeypatch):
    """SIGINT to the launching process only (not its process group: a `kill -INT PID`, a job scheduler): it passes
    the signal on; the ranks stop after the same step and save; the launch is `interrupted`. Before, the launcher
    only noted the signal and the ranks trained on."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = tmp_path / "launcher"

    def interrupt_when_training():
        deadline = time.monotonic() + 300
        memory = RunDir(run).memory_file()
        while time.monotonic() < deadline:
            if memory.is_file() and '"phase": "optimizer"' in memory.read_text():
                os.kill(os.getpid(), signal.SIGINT)  # caught by launch.run's handler in the main thread
                return
            time.sleep(0.1)

    args = argv(tiny_model, tmp_path, "launcher")
    args[args.index(f"training.max_steps={STEPS}")] = "training.max_steps=500"  # still training when it lands
    threading.Thread(target=interrupt_when_training, daemon=True).start()
    started = time.monotonic()
    assert main(args) == 130
    took = time.monotonic() - started
    line, _ = the_error(capfd)
    status = RunDir(run).read_status()
    assert (status.state, status.signal, status.rank) == ("interrupted", "SIGINT", 0)
    step = status.step
    assert line.startswith(
        f"interrupted by SIGINT: stopped after step {step}; kept {run}/checkpoints/checkpoint-{step}"
    )
    assert checkpoint_problem(run / "checkpoints" / f"checkpoint-{step}") is None
    print(f"launcher interrupted: the launch ended in {took:.0f} s, after step {step}")
