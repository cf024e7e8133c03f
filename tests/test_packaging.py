"""Installed as users install it: the wheel, not the checkout, in a fresh virtual environment.

The fresh environment sees this test environment's site-packages (torch, transformers, ...) through a `.pth` line —
no download, no CUDA torch — but not the editable lowmem_ft, whose `.pth` hook only runs for a site directory, not
for a path a `.pth` line adds. Commands run from a directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a fresh venv with the lowmem-ft wheel built from this checkout installed (not editable)."""
    tmp = tmp_path_factory.mktemp("wheel")
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), str(ROOT)],
        cwd=tmp,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp.glob("lowmem_ft-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    (purelib,) = env_dir.glob("lib/python*/site-packages")
    (purelib / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    python = env_dir / "bin" / "python"
    done = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], tmp)
    assert done.returncode == 0, done.stderr
    return env_dir / "bin"


def test_wheel_ships_the_recipes_and_the_catalog(installed, tmp_path):
    where = _run([str(installed / "python"), "-c", "import lowmem_ft; print(lowmem_ft.__file__)"], tmp_path)
    assert str(installed.parent) in where.stdout and str(ROOT) not in where.stdout  # the wheel, not the checkout
    listed = _run([str(installed / "lowmem-ft"), "recipes"], tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert all(name in listed.stdout for name in ("8gb", "24gb", "40gb", "base"))
    shown = _run([str(installed / "lowmem-ft"), "recipes", "show", "24gb"], tmp_path)
    assert shown.returncode == 0 and "max_seq_len: 2048" in shown.stdout, shown.stderr


def test_installed_plan_runs_outside_the_checkout(installed, tmp_path):
    planned = _run(
        [str(installed / "lowmem-ft"), "plan", "--vram", "24", "--model", "Qwen/Qwen2.5-7B", "--json"], tmp_path
    )
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["fits"] and plan["recipe"]["model"]["name_or_path"] == "Qwen/Qwen2.5-7B"
    no_torch = _run(
        [
            str(installed / "python"),
            "-c",
            "import sys; from lowmem_ft.cli import main; "
            "main(['plan', '--vram', '24', '--model', 'Qwen/Qwen2.5-7B']); assert 'torch' not in sys.modules",
        ],
        tmp_path,
    )
    assert no_torch.returncode == 0, no_torch.stderr
