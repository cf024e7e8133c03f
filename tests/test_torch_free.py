"""The memory model's, the recipe's and the planner's tests run where torch is not installed.

`tests/torch_blocker.py` makes `import torch` fail in a child pytest: nothing at collection may import torch (the
CUDA skip in `tests/conftest.py` imports it only when a `requires_cuda` test was collected), and the tests of the
pure-arithmetic layers pass without it. Tests that compare with what transformers builds, or measure real tensors,
need torch and say so by failing (or, at module level, by `pytest.importorskip`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# collected without torch: every test module of these (a module that needs torch skips itself with importorskip)
COLLECTED = ["tests/memory", "tests/recipe", "tests/commands/test_plan.py"]
# run without torch, every test passing (a sample that stays quick: the suite runs them with torch too)
TORCH_FREE = [
    "tests/memory/test_estimate.py",
    "tests/memory/test_estimate_phases.py",
    "tests/memory/test_layout.py",
    "tests/memory/test_long_context.py",
    "tests/memory/test_planner.py",
    "tests/memory/test_preference_memory.py",
    "tests/memory/test_sharding.py",
    "tests/recipe/test_load.py",
    "tests/test_imports.py",
]


def _pytest_without_torch(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "tests.torch_blocker",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def test_the_blocker_blocks_torch():
    done = _pytest_without_torch("--collect-only", "tests/memory/test_estimate_loss.py")
    assert done.returncode == 5, done.stdout + done.stderr  # 5: nothing collected, the module skipped for want of torch


def test_collection_needs_no_torch():
    done = _pytest_without_torch("--collect-only", *COLLECTED)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " error" not in done.stdout.splitlines()[-1]


def test_the_memory_model_tests_pass_without_torch():
    done = _pytest_without_torch(*TORCH_FREE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "skipped" not in done.stdout.splitlines()[-1], done.stdout.splitlines()[-1]
