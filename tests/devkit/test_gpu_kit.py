"""devkit/gpu/kit.py: the wheels the device image lacks, pinned to what the tests run with, under 64 MiB.

CI has no kit: the plan and the bitsandbytes stripping are checked offline; the kit itself (installed the way
gpu_check.sh installs it, then imported) is checked when `.gpukit/` has been built here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from devkit.gpu import kit

ROOT = Path(__file__).resolve().parents[2]
BUILT = (ROOT / ".gpukit" / "manifest.json").is_file()


def test_dry_run_pins_what_the_tests_run_with(capsys):
    assert kit.main(["--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in plan["packages"]] == list(kit.CARRY)
    assert {"bitsandbytes", "trl", "datasets", "dill", "multiprocess"} <= set(kit.CARRY)  # missing on the image
    for p in plan["packages"]:
        assert p["version"] == version(p["name"])
        assert f"{p['name']}=={p['version']}" in plan["pip"]
    cmd = " ".join(plan["pip"])
    assert "download --no-deps --only-binary=:all: --python-version 3.12" in cmd
    assert "--platform manylinux_2_24_x86_64" in cmd  # bitsandbytes 0.50's tag: pip matches tags exactly


def test_with_adds_a_distribution_at_a_given_version():
    packages = {p["name"]: p for p in kit.pinned(["pyarrow==24.0.0", "xxhash"])}
    assert packages["pyarrow"]["version"] == "24.0.0"
    assert packages["xxhash"]["version"] == version("xxhash")
    assert "bitsandbytes" in packages


def _fake_wheel(path: Path) -> list[str]:
    names = [
        "bitsandbytes/__init__.py",
        "bitsandbytes/libbitsandbytes_cpu.so",
        "bitsandbytes/libbitsandbytes_cuda118.so",
        "bitsandbytes/libbitsandbytes_cuda130.so",
        "bitsandbytes/libbitsandbytes_rocm72.so",
        "bitsandbytes/nn/modules.py",
    ]
    record = "".join(f"{n},sha256=x,{len(n)}\n" for n in names) + "bitsandbytes-0.50.2.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("bitsandbytes-0.50.2.dist-info/RECORD", record)  # first, before the libraries it lists
        for n in names:
            z.writestr(n, n * 100)
    return names


def test_strip_bitsandbytes_keeps_cuda130_and_cpu_and_fixes_record(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    names = _fake_wheel(wheel)
    removed = kit.strip_bitsandbytes(wheel)
    gone = {"bitsandbytes/libbitsandbytes_cuda118.so", "bitsandbytes/libbitsandbytes_rocm72.so"}
    assert set(removed) == gone
    with zipfile.ZipFile(wheel) as z:
        left = set(z.namelist())
        record = z.read("bitsandbytes-0.50.2.dist-info/RECORD").decode().splitlines()
        assert z.read("bitsandbytes/nn/modules.py") == b"bitsandbytes/nn/modules.py" * 100
    assert left == (set(names) - gone) | {"bitsandbytes-0.50.2.dist-info/RECORD"}
    listed = {line.split(",", 1)[0] for line in record}
    assert listed == left  # every file listed once, nothing removed still listed


@pytest.mark.skipif(not BUILT, reason="the kit is not built here (python -m devkit.gpu.kit)")
def test_kit_fits_the_device_tool_limit():
    total, report = kit.size_report()
    assert total < kit.LIMIT_BYTES, report
    manifest = json.loads((ROOT / ".gpukit" / "manifest.json").read_text())
    for p in manifest["packages"]:
        wheel = ROOT / ".gpukit" / "wheels" / p["file"]
        assert wheel.stat().st_size == p["bytes"] and kit.sha256(wheel) == p["sha256"]


@pytest.mark.slow
@pytest.mark.skipif(not BUILT, reason="the kit is not built here (python -m devkit.gpu.kit)")
def test_kit_installs_as_gpu_check_installs_it_and_imports(tmp_path):
    """pip --no-index --no-deps --target, as on the device (with its Python 3.12 tags); then each package whose
    wheel runs on any Python 3 imports from the kit here. The rest (cp312 / py312 wheels) must carry 3.12 tags."""
    wheels = sorted((ROOT / ".gpukit" / "wheels").glob("*.whl"))
    platforms = [x for p in kit.PLATFORMS for x in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    cmd += [str(tmp_path), "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", *platforms]
    subprocess.run([*cmd, *map(str, wheels)], check=True, capture_output=True)
    manifest = json.loads((ROOT / ".gpukit" / "manifest.json").read_text())
    portable = [p for p in manifest["packages"] if "-py3-none-" in p["file"]]
    for p in manifest["packages"]:
        if p not in portable:
            assert "-cp312-" in p["file"] or "-py312-" in p["file"], p["file"]
            # Python 3.12 builds do not load on this Python: let the venv's own copy stand in for them
            with zipfile.ZipFile(ROOT / ".gpukit" / "wheels" / p["file"]) as z:
                for top in {n.split("/", 1)[0] for n in z.namelist()}:
                    shutil.rmtree(tmp_path / top, ignore_errors=True)
    assert (tmp_path / "bitsandbytes" / "libbitsandbytes_cuda130.so").is_file()
    assert not list((tmp_path / "bitsandbytes").glob("libbitsandbytes_cuda12*.so"))
    modules = {"bitsandbytes": "bitsandbytes", "trl": "trl", "datasets": "datasets", "dill": "dill"}
    modules |= {"transformers": "transformers", "peft": "peft", "accelerate": "accelerate"}
    names = [modules[p["name"]] for p in portable if p["name"] in modules]
    code = f"import importlib, json; print(json.dumps({{n: importlib.import_module(n).__file__ for n in {names!r}}}))"
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    files = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(files) == set(names)
    for name, file in files.items():
        assert Path(file).is_relative_to(tmp_path), f"{name} imported from {file}, not from the kit"
