"""Shared fixtures: the embedded tiny model and the zoo (built once per session), the CUDA marker, and the
memory-model check every CPU training run of every test goes through."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATA = os.path.join(os.path.dirname(__file__), "data")


def pytest_configure(config):
    """Under pytest-xdist the workers share the machine's cores: torch's intra-op threads (one per core by default)
    in every worker, and in the training processes tests start, would oversubscribe them. One thread each, unless
    the environment says otherwise (torch reads OMP_NUM_THREADS when it is imported, which the tests do lazily)."""
    if hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """`requires_cuda` tests skip without a CUDA device. torch is imported only when such a test was collected, so
    the torch-free tests (the memory model, recipes, planning) collect and run where torch is not installed.

    Under pytest-xdist each test module goes to one worker whole (`--dist loadscope`, pyproject.toml), so a fixture
    a module builds once (a training run, a two-rank launch, a wheel in a fresh venv) is built once, not once per
    worker that runs one of its tests; and the modules with the most slow work go first (`_longest_first`), so the
    longest work starts while the other worker still has short modules to fill in with."""
    if hasattr(config, "workerinput"):
        _longest_first(items)
    cuda_items = [item for item in items if "requires_cuda" in item.keywords]
    if not cuda_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in cuda_items:
        item.add_marker(skip)


# `train --gpus 2` launches each module makes, read from the tests: a launch (accelerate launch, two CPU gloo ranks that
# each import torch, transformers, TRL and peft) costs 100-135 s of wall time on the shared 2-core machine (pytest
# --durations, -n 0, load average 15), ten times a typical slow test. A scheduling hint only: a wrong count costs time.
LAUNCHES = {
    "tests/train/test_launch_faults.py": 6,  # a baseline, one run through 3 faults (4 launches), an interrupt
    "tests/train/test_preference_runs.py": 2,  # the DPO launch and its resume
    "tests/train/test_grpo_training.py": 1,
    "tests/train/test_faults.py": 1,  # Ctrl-C under --gpus (its other runs fork from a pre-imported server)
    "tests/train/distributed/test_launch.py": 1,
    "tests/vision/test_vision_runs_e2e.py": 2,  # an image run on two ranks and its resume
}


def _longest_first(items) -> None:
    """Order modules by a rough cost, most first — a module's `slow` tests, and ten for each launch it makes
    (`LAUNCHES`) — each module's tests kept together and in order (a stable sort: the same in every worker, as xdist
    requires). With `--dist loadscope` a worker takes the next module when it runs short, so the longest modules
    start first and the short ones fill in at the end."""
    cost: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        cost.setdefault(module, 10 * LAUNCHES.get(module, 0))
        cost[module] += "slow" in item.keywords
    items.sort(key=lambda item: -cost[item.nodeid.split("::")[0]])


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _each_test_a_fresh_command():
    """Warnings said once per command (`console.first_time`) start afresh in each test, as `console.setup` does
    for each command: otherwise a warning one test caused would be missing from the next test's output."""
    from lowmem_ft import console

    console._SAID.clear()


# The host RAM a plan may use when a test does not say (`--host-ram`): a roomy machine's, the same on every machine the
# suite runs on, so a plan does not depend on what else the test machine is running. Host-RAM tests set their own.
TEST_HOST_RAM_GB = 512.0


@pytest.fixture(autouse=True)
def _a_fixed_host_ram(monkeypatch):
    monkeypatch.setattr("lowmem_ft.choosing.detected_host_ram_gb", lambda: TEST_HOST_RAM_GB)


# This GPU's calibration (`lowmem_ft.calibrated`) is read from a directory that does not exist (a test that records
# one points it at its own tmp_path): a developer's real calibration in ~/.cache would move every plan a test checks
# on a GPU machine.
_CALIBRATIONS = Path(tempfile.gettempdir()) / "lowmem-ft-tests-no-calibration" / str(os.getpid())


@pytest.fixture(autouse=True)
def _no_calibration_of_the_machine(monkeypatch):
    monkeypatch.setattr("lowmem_ft.calibrated.calibration_dir", lambda: _CALIBRATIONS)


@pytest.fixture(autouse=True)
def _forget_bnb_module_overrides():
    """transformers' Trainer (and the measurement harnesses) register every nn.Embedding with bitsandbytes'
    process-wide `GlobalOptimManager` (32-bit optimizer states for embeddings, trainer.py create_optimizer), and
    the manager turns them into overrides by parameter id and by parameter position (`pid2config`,
    `index2config`) that nothing clears: a later test's optimizer whose first parameter sits where an embedding sat
    got 32-bit states (doctor's 8-bit check failed after the tracer's tests), and each in-process run's embedding
    would outlive its test and be counted by later exact memory measurements. `initialize()` forgets all of it."""
    yield
    optim = sys.modules.get("bitsandbytes.optim")
    if optim is not None:
        optim.GlobalOptimManager.get_instance().initialize()


_TEST_DIRS: set = set()  # every test's own tmp_path so far: the other directories under the base are fixtures'
_FIXTURE_DIRS: set = set()  # fixtures' directories already looked at
_CHECKED: set = set()  # memory files already checked


_FROZEN_AT: list = [None]  # the module whose first test froze the heap last


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At each module's first test, before its fixtures: collect what earlier modules left, then freeze the survivors
    (`gc.freeze`: imported libraries, session fixtures) out of later collections. A full `gc.collect()` then walks
    only what was made since — the tracer calls it after each trace, and over a worker's ~600,000 imported objects
    each call took ~0.5 s (tests/train/trace/test_step.py and test_verify.py: 36 calls, 17 s of 91). A frozen
    object is still freed by its reference count; only a reference cycle among objects alive at a module's start
    outlives them (a module's own fixtures are made after its freeze and collected at the next module's start)."""
    module = item.nodeid.split("::")[0]
    if _FROZEN_AT[0] != module:
        _FROZEN_AT[0] = module
        gc.collect()
        gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After a test passes: every run it trained on the CPU measured its memory exactly, and the memory model must
    agree with it (tests/train/tiny_runs.py `memory_disagreements`, ≤ 8 % per run and per phase).

    Checked: the runs under the test's `tmp_path`, and the runs its fixtures made in `tmp_path_factory` directories
    (module- and session-scoped fixtures: the base directory's other folders, after the first test that ran with
    them; `pytest_sessionfinish` checks them all once more for runs added later). A test opts its own runs out with
    `@pytest.mark.memory_unchecked(reason=...)`, saying why; fixtures' runs are always checked."""
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if tmp is not None:
        _TEST_DIRS.add(tmp)  # before the test runs: a failed test's directory is not a fixture's
    result = yield
    unchecked = item.get_closest_marker("memory_unchecked")
    assert unchecked is None or unchecked.kwargs.get("reason"), "memory_unchecked needs reason=... (why not checked)"
    files = _memory_files(tmp) if tmp is not None and unchecked is None else []
    new = [d for d in _fixture_dirs(item.config) if d not in _FIXTURE_DIRS]
    _FIXTURE_DIRS.update(new)
    problems = _disagreements(files + [f for d in new for f in _memory_files(d)])
    assert not problems, "the memory model disagrees with the exact CPU measurement:\n" + "\n".join(problems)
    return result


def pytest_sessionfinish(session, exitstatus):
    """Fixtures' runs made or continued after their first test: checked once more at the end (a failure fails the
    session). Under pytest-xdist each worker is a session of its own with its own base directory: a worker checks
    its fixtures' runs and hands what disagrees to the controller (`workeroutput`), which reports it and fails."""
    config = session.config
    if config.pluginmanager.getplugin("dsession") is not None and not hasattr(config, "workeroutput"):
        problems = _WORKER_PROBLEMS  # the xdist controller: the workers checked their own base directories
    else:
        files = [f for d in _fixture_dirs(config) for f in _memory_files(d) if f not in _CHECKED]
        problems = _disagreements(files)
        if hasattr(config, "workeroutput"):  # an xdist worker: its terminal is not shown, the controller reports
            config.workeroutput["memory_problems"] = problems
            return
    if problems:
        session.config.get_terminal_writer().line(
            "the memory model disagrees with the exact CPU measurement of fixtures' runs:\n" + "\n".join(problems),
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_WORKER_PROBLEMS: list[str] = []  # on the xdist controller: what the workers' end-of-session checks found


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: a worker finished; keep what its end-of-session memory check found (pytest_sessionfinish)."""
    _WORKER_PROBLEMS.extend(getattr(node, "workeroutput", {}).get("memory_problems", []))


def _fixture_dirs(config) -> list:
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or factory._basetemp is None:  # nothing made a temporary directory yet
        return []
    return [d for d in factory.getbasetemp().iterdir() if d.is_dir() and not d.is_symlink() and d not in _TEST_DIRS]


def _memory_files(root) -> list:
    return sorted(root.rglob("memory*.jsonl"))


def _disagreements(files: list) -> list[str]:
    if not files:
        return []
    from tests.train.tiny_runs import memory_disagreements

    _CHECKED.update(files)
    return [problem for path in files for problem in memory_disagreements(path)]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of a freshly built tiny Qwen2 model with its tokenizer."""
    from devkit.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2"))


@pytest.fixture(scope="session")
def zoo_models(tmp_path_factory) -> dict[str, str]:
    """Every zoo family (devkit/zoo.py): name → model directory, this session's copy of the zoo built once on disk
    for every session and worker (tests/zoo_cache.py)."""
    from tests.zoo_cache import zoo

    return {name: str(path) for name, path in zoo(tmp_path_factory.mktemp("zoo")).items()}


@pytest.fixture(scope="session")
def vl_checkpoint(tmp_path_factory):
    """name → the tiny checkpoint directory of zoo family `name`, built once per session (the image families, which the
    text zoo of `zoo_models` leaves out)."""
    from devkit.zoo import build

    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build(name, tmp_path_factory.mktemp("zoo") / name))
        return built[name]

    return get


@pytest.fixture
def chat_data() -> str:
    return os.path.join(os.path.dirname(__file__), "..", "examples", "chat.jsonl")


@pytest.fixture(scope="session")
def finished_run(tiny_model, tmp_path_factory) -> str:
    """A finished LoRA run of the tiny model (2 steps, a checkpoint after each): recipe.yaml, run.json, adapter/,
    checkpoints/checkpoint-1 and -2. Shared by the tests that hand commands damaged or hostile copies of it."""
    from tests.train.tiny_runs import tiny_run

    out = tmp_path_factory.mktemp("finished")
    data = os.path.join(os.path.dirname(__file__), "..", "examples", "chat.jsonl")
    tiny_run(
        tiny_model, data, out, "done", "training.max_steps=2", "training.save_steps=1", "logging.wandb_mode=disabled"
    )
    return str(out / "done")
