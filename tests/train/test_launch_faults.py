"""A launch fails as one (issue #24): `train --gpus 2` (two CPU gloo ranks through accelerate launch) where one rank
is killed, hangs, or raises, or where the launching process alone is interrupted. Every rank stops within a bounded
time, run.json says `failed` / `interrupted` with the reason and the rank, the last complete checkpoint is kept, and
`--resume` reaches the losses and the adapter of a launch that was never stopped.

The faults are injected by tests/train/faulty_rank.py, which the ranks run in place of `lowmem_ft` (no hook in the
package), on rank 1, after a checkpoint after each step. One run goes through every fault, each `--resume` of the
last taking it one step further: killed in step 3, its resume hangs in step 4, that one's resume raises in step 5,
and the last resume finishes — so each fault's kept checkpoint is the one the next launch resumes from, and the end
must be the uninterrupted launch bit for bit (four launches where a fresh run and a resume per fault took six). The
runs are the smallest the suite has: the tiny model, 5 steps of 2 × (4 × 2) samples, 48 tokens.
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
STEPS = 5
ADAPTER = "adapter/adapter_model.safetensors"
# training.rank_timeout_s of these runs: how long the others wait for a hung rank once every rank is built (building
# waits for the slowest rank's imports regardless: lowmem_ft.train.distributed.ranks), above a step's and a save's
# skew between the ranks on a loaded 2-core host (a step of these runs takes about 0.3 s on a quiet one)
TIMEOUT_S = 10


def argv(model: str, out: Path, name: str) -> list[str]:
    args = ["train", "--recipe", "8gb", "--gpus", "2", "--name", name, "--no-wandb"]
    sets = tiny_sets(model, DATA, out, f"training.max_steps={STEPS}", "training.save_steps=1",
                     f"training.rank_timeout_s={TIMEOUT_S}")  # fmt: skip
    for item in sets:
        args += ["--set", item]
    return args


@pytest.fixture
def faulty(monkeypatch):
    """Make the ranks of the next launch run tests.train.faulty_rank with FAULT at `step` on rank 1."""

    def arm(fault: str, step: int) -> None:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setenv("FAULT", fault)
        monkeypatch.setenv("FAULTY_RANK", "1")
        monkeypatch.setenv("FAULTY_STEP", str(step))
        run = launch.run

        def entry(cmd):
            at = cmd.index("-m")
            return run([*cmd[: at + 1], "tests.train.faulty_rank", *cmd[at + 2 :]])

        monkeypatch.setattr(launch, "run", entry)

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


def assert_kept_checkpoint(run: Path, step: int) -> None:
    kept = RunDir(run).last_checkpoint()
    assert kept is not None and kept.name == f"checkpoint-{step}" and checkpoint_problem(kept) is None
    assert sorted(p.name for p in kept.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]


# each fault on rank 1, the step it strikes in, and the start of the launcher's one line
FAULTS = [
    ("kill", 3, "rank 1 ended without a word (killed, or out of host memory)"),
    ("hang", 4, f"rank 1 stopped responding: the other ranks waited {TIMEOUT_S} s for it at a collective"),
    ("error", 5, "rank 1 failed during step 5: ValueError: a bad sample in rank 1's shard"),
]


def test_one_rank_ends_the_launch_and_resume_goes_on(tiny_model, tmp_path, baseline, faulty, monkeypatch, capfd):
    """Killed, hung or raising, rank 1 ends the launch in one line naming it; the checkpoint before the fault is kept
    whole with both ranks' RNG states; `--resume` goes on from it (into the next fault) and ends where the
    uninterrupted launch ended, losses and adapter bit for bit."""
    run = tmp_path / "faulty"
    took: dict[str, float] = {}  # printed at the end: the next launch's captured output would swallow a print here
    for fault, step, expected in FAULTS:
        faulty(fault, step)
        resume = ["train", "--resume", str(run), "--gpus", "2", "--no-wandb"]
        started = time.monotonic()
        assert main(argv(tiny_model, tmp_path, "faulty") if fault == "kill" else resume) == 2, fault
        took[f"{fault} in step {step}"] = time.monotonic() - started
        line, _ = the_error(capfd)
        assert line.startswith(expected), (fault, line)
        kept = f"kept {run}/checkpoints/checkpoint-{step - 1} (step {step - 1})"
        assert line.endswith(f"{kept}; continue with: lowmem-ft train --resume {run}"), (fault, line)
        status = RunDir(run).read_status()
        assert (status.state, status.rank, status.reason) == ("failed", 1, line), fault
        assert_kept_checkpoint(run, step - 1)
        assert "Traceback" not in line
        monkeypatch.undo()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["train", "--resume", str(run), "--gpus", "2", "--no-wandb"]) == 0
    assert losses(run) == losses(baseline) and len(losses(run)) == STEPS
    a, b = load_file(run / ADAPTER), load_file(baseline / ADAPTER)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert RunDir(run).read_status().state == "completed"
    print("; ".join(f"{fault}: the launch ended in {seconds:.0f} s" for fault, seconds in took.items()))


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
