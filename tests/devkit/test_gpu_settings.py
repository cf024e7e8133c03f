"""The GPU check's limits are settings: the defaults the device tool's terms give, overridden by the environment."""

from __future__ import annotations

import pytest

from devkit.gpu.settings import GpuSettings, StepTime


def test_defaults_are_the_device_tools_terms():
    s = GpuSettings.from_env({})
    assert s.travel_bytes == 64 * 2**20 and s.command_s == 600
    assert s.deadline_s + s.reserve_s < s.command_s  # the steps end inside one command, with set-up left over
    assert s.train.seconds(7.6) == pytest.approx(40 + 3 * 7.6)


def test_the_environment_overrides_a_limit_or_a_step():
    s = GpuSettings.from_env({"LOWMEM_GPU_DEADLINE_S": "300", "LOWMEM_GPU_TRAIN": "60,4", "LOWMEM_GPU_PROBE": "5"})
    assert s.deadline_s == 300.0 and s.train == StepTime(60, 4) and s.probe == StepTime(5)
    assert s.point == GpuSettings().point  # the rest keep their defaults


def test_a_bad_override_is_one_line():
    with pytest.raises(SystemExit, match="LOWMEM_GPU_TRAVEL_BYTES='64MB': expected a whole number"):
        GpuSettings.from_env({"LOWMEM_GPU_TRAVEL_BYTES": "64MB"})


def test_the_kit_and_the_check_read_the_settings():
    """A lease's changed terms reach the check through the environment: its --deadline default follows it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from devkit.gpu import check, kit
    from devkit.gpu.settings import SETTINGS

    assert SETTINGS.travel_bytes == kit.LIMIT_BYTES and not hasattr(check, "RESERVE_S")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "LOWMEM_GPU_DEADLINE_S": "300", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "devkit.gpu.check", "run", "--help"], cwd=root, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "(default 300, LOWMEM_GPU_DEADLINE_S)" in " ".join(done.stdout.split())
