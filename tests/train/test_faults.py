"""The fault suite with real processes (issue #16): kill -9 at random points, mid-save included, then `--resume`;
SIGINT, to one process and to the process group of `train --gpus 2`; two runs on one name. Every interrupted run ends with the loss history and the adapter of an uninterrupted
run, bit for bit, under the shipped LoRA dropout (0.05).

The runs are `lowmem-ft train` processes on the tiny model (6 optimizer steps, a checkpoint after each), run
through tests/train/faulty_save.py, which can slow the steps down or pause inside a save so that a kill lands there.
The kill times are drawn from a seeded generator; where they land still depends on the machine's speed, and every
landing place must end the same way.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lowmem_ft.cli import main
from lowmem_ft.rundir import RunDir, checkpoint_problem
from tests.train import faulty_save
from tests.train.tiny_runs import memory_records, tiny_sets

pytestmark = pytest.mark.slow
DATA = "tests/data/numbered.jsonl"
STEPS = 6
ADAPTER = "adapter/adapter_model.safetensors"


def train_argv(model: str, out: Path, name: str, *extra: str) -> list[str]:
    argv = ["train", "--recipe", "8gb", "--name", name, "--no-wandb"]
    sets = tiny_sets(model, DATA, out, f"training.max_steps={STEPS}", "training.save_steps=1", *extra)
    sets.append("adapter.dropout=0.05")  # the shipped default (FAST turns it off), after FAST so it wins
    for item in sets:
        argv += ["--set", item]
    return argv


def _cli(argv: list[str], log: str, env: dict[str, str]) -> None:
    """The body of a run's process: `lowmem-ft ARGV` through faulty_save, its output appended to `log`."""
    os.environ.update(env)
    torch.set_num_threads(1)  # like the other tiny runs, and the same in every process (bitwise-equal results)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = ["lowmem-ft", *argv]
    code = faulty_save.main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


@pytest.fixture(scope="module")
def processes():
    """Processes forked from a server that imported lowmem-ft, torch and transformers once (the imports take ~9 s
    of a ~12 s run here), so that each run starts in well under a second. A fork is a real process: SIGKILL,
    SIGINT, its exit code and its pid (the run directory's lock) are what they are for `lowmem-ft train`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.train.test_faults"])
    return context


def start(processes, argv: list[str], log: Path, **env: str):
    process = processes.Process(target=_cli, args=(argv, str(log), {"WANDB_MODE": "disabled", **env}))
    process.start()
    return process


def finish(process, log: Path) -> int:
    process.join(timeout=600)
    if process.exitcode not in (0, 2, 130, 143, -signal.SIGKILL):
        pytest.fail(f"exit code {process.exitcode}:\n{log.read_text()[-3000:]}")
    return process.exitcode


def wait_for(condition, process, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if not process.is_alive():
            pytest.fail(f"the run ended ({process.exitcode}) before the test could act:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def trained(run: Path) -> bool:
    """At least one training sample is in memory.jsonl: the run is past loading."""
    path = RunDir(run).memory_file()
    return path.is_file() and '"phase": "forward"' in path.read_text()


def losses(run: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (run / "log_history.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def assert_same_run(run: Path, baseline: Path) -> None:
    assert losses(run) == losses(baseline) and len(losses(run)) == STEPS
    a, b = load_file(run / ADAPTER), load_file(baseline / ADAPTER)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), max((a[k] - b[k]).abs().max().item() for k in a)
    assert RunDir(run).read_status().state == "completed"


def samples(run: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["phase"]) for r in memory_records(run) if "phase" in r]


def assert_memory_log_continues(run: Path, baseline: Path) -> None:
    """memory.jsonl of a resumed run: steps in order, none twice — at most the uninterrupted run's samples of each
    (step, phase); a kill -9 may lose the last few the monitor had not flushed — and all of its last step."""
    got, want = samples(run), samples(baseline)
    assert [step for step, _ in got] == sorted(step for step, _ in got)
    assert not Counter(got) - Counter(want), Counter(got) - Counter(want)
    assert [s for s in got if s[0] == STEPS] == [s for s in want if s[0] == STEPS]


@pytest.fixture(scope="module")
def baseline(processes, tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults")
    log = out / "baseline.log"
    assert finish(start(processes, train_argv(tiny_model, out, "baseline"), log), log) == 0
    return out / "baseline"


def test_kill_9_at_random_points_and_mid_save_then_resume_is_exact(processes, baseline, tiny_model, tmp_path):
    rng = random.Random(16)
    run, log = tmp_path / "killed", tmp_path / "killed.log"
    argv = train_argv(tiny_model, tmp_path, "killed")
    resume = ["train", "--resume", str(run), "--no-wandb"]

    # 1. kill -9 at a random moment of training (steps slowed to 0.4 s, so it lands mid-run)
    process = start(processes, argv, log, SLOW_STEP_S="0.4")
    wait_for(lambda: trained(run), process, log)
    time.sleep(rng.uniform(0.2, 2.5))
    process.kill()
    finish(process, log)
    kept = RunDir(run).resume_point()

    # 2. continue — or, killed before its first checkpoint, start again under the same name — and kill -9 inside
    #    a save: weights and optimizer written, trainer_state.json not yet
    done = kept.step or 0
    pause_at = rng.randint(done + 1, STEPS - 1)
    marker = tmp_path / "saving"
    process = start(
        processes, resume if kept.checkpoint else argv, log, PAUSE_SAVE_AT=str(pause_at), PAUSE_MARKER=str(marker)
    )
    wait_for(marker.exists, process, log)
    process.kill()
    finish(process, log)
    staged = RunDir(run).staging / f"checkpoint-{pause_at}"
    assert staged.is_dir() and checkpoint_problem(staged) is not None  # the cut save, never under its final name
    assert not (run / "checkpoints" / f"checkpoint-{pause_at}").exists()
    assert RunDir(run).last_checkpoint().name == f"checkpoint-{pause_at - 1}"
    status = RunDir(run).read_status()
    assert status.state == "running" and "killed?" in RunDir(run).describe_status()  # it had no time to say

    # 3. continue to the end: the cut save is cleared, the run resumes from the checkpoint before it
    process = start(processes, resume, log)
    assert finish(process, log) == 0
    assert f"resuming from checkpoint-{pause_at - 1}" in log.read_text()
    assert not RunDir(run).staging.exists()
    assert_same_run(run, baseline)
    assert_memory_log_continues(run, baseline)
    print(f"killed at step {done} (kept {kept.checkpoint and kept.checkpoint.name}), then inside save {pause_at}")


def test_sigint_saves_after_the_step_and_resume_is_exact(processes, baseline, tiny_model, tmp_path):
    run, log = tmp_path / "sigint", tmp_path / "sigint.log"
    # no checkpoint but the one the interrupt saves
    process = start(
        processes, train_argv(tiny_model, tmp_path, "sigint", "training.save_steps=100"), log, SLOW_STEP_S="0.4"
    )
    wait_for(lambda: trained(run), process, log)
    time.sleep(0.5)
    os.kill(process.pid, signal.SIGINT)
    assert finish(process, log) == 130
    status = RunDir(run).read_status()
    assert status.state == "interrupted" and status.signal == "SIGINT"
    step = status.step
    assert 1 <= step < STEPS
    (line,) = [x for x in log.read_text().splitlines() if "lowmem-ft train: error:" in x]
    assert f"interrupted by SIGINT: stopped after step {step}; kept {run}/checkpoints/checkpoint-{step}" in line
    assert line.endswith(f"continue with: lowmem-ft train --resume {run}") and "Traceback" not in log.read_text()
    assert [p.name for p in RunDir(run).checkpoint_dirs()] == [f"checkpoint-{step}"]
    assert checkpoint_problem(run / "checkpoints" / f"checkpoint-{step}") is None
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["interrupted"] == "SIGINT" and metrics["stopped_after_step"] == metrics["global_step"] == step
    assert len(losses(run)) == step and not (run / "adapter").exists()

    assert finish(start(processes, ["train", "--resume", str(run), "--no-wandb"], log), log) == 0
    assert_same_run(run, baseline)
    train_phases = [s for s in samples(run) if s[1] != "save"]  # this run saved only at the interrupt
    assert train_phases == [s for s in samples(baseline) if s[1] != "save"]  # each step once, in order


def test_two_runs_on_one_name(processes, tiny_model, tmp_path, capsys):
    run, log = tmp_path / "same", tmp_path / "same.log"
    argv = train_argv(tiny_model, tmp_path, "same")
    first = start(processes, argv, log, SLOW_STEP_S="0.8")
    wait_for(lambda: trained(run), first, log)

    for second in (argv, ["train", "--resume", str(run), "--no-wandb"]):
        assert main(second) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert f"run directory {run} is in use by another lowmem-ft run (pid {first.pid} on " in err
    assert finish(first, log) == 0  # the first run, untouched
    assert json.loads((run / "metrics.json").read_text())["global_step"] == STEPS
    assert RunDir(run).read_status().state == "completed" and not RunDir(run).in_use()


def test_ctrl_c_under_gpus_stops_every_rank_after_the_same_step(tiny_model, tmp_path):
    """`train --gpus 2` (two CPU gloo ranks through accelerate launch) in its own process group, sent SIGINT as a
    terminal's Ctrl-C sends it: to every process of the group. torchrun forwards it to the ranks a second time; the
    ranks agree on the step, save one checkpoint and exit 130; the launching process waits for them and exits 130."""
    out, log = tmp_path, tmp_path / "gpus.log"
    argv = [sys.executable, "-m", "lowmem_ft", "train", "--recipe", "8gb", "--gpus", "2", "--name", "ddp", "--no-wandb"]
    for item in tiny_sets(tiny_model, DATA, out, "training.max_steps=500", "training.save_steps=1000"):
        argv += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    with log.open("w") as handle:
        process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    run = out / "ddp"
    deadline = time.monotonic() + 300
    while not (trained(run) and '"phase": "optimizer"' in RunDir(run).memory_file().read_text()):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=120) == 130, log.read_text()[-3000:]
    status = RunDir(run).read_status()
    assert status.state == "interrupted" and status.signal == "SIGINT"
    assert [p.name for p in RunDir(run).checkpoint_dirs()] == [f"checkpoint-{status.step}"]
    checkpoint = run / "checkpoints" / f"checkpoint-{status.step}"
    assert checkpoint_problem(checkpoint) is None
    assert sorted(p.name for p in checkpoint.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    text = log.read_text()
    assert "Traceback" not in text and text.count(f"stopped after step {status.step}; kept {checkpoint}") == 3
