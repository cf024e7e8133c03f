"""`lowmem-ft doctor` on this CPU machine: real checks pass, missing pieces fail with a fix, exit codes follow."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lowmem_ft.cli import main
from lowmem_ft.commands import doctor


def _json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["doctor", "--json", *argv])
    return rc, json.loads(capsys.readouterr().out)


def test_cpu_machine_can_train_and_reports_no_gpu(capsys, tmp_path):
    rc, report = _json(capsys, "--output-dir", str(tmp_path / "runs"))
    checks = {c["name"]: c for c in report["checks"]}
    if "GPU" in checks:  # this machine (the CPU build of torch): a warning, training still runs
        assert checks["GPU"]["status"] == "warn" and "no CUDA GPU" in checks["GPU"]["detail"]
        assert checks["GPU"]["fix"]
    assert rc == 0 and report["can_train"]
    assert checks["bitsandbytes 4-bit"]["status"] == "ok"
    assert checks["bitsandbytes 8-bit"]["status"] == "ok" and "uint8" in checks["bitsandbytes 8-bit"]["detail"]
    assert checks["attention"]["status"] == "ok"
    assert "offline mode" in checks["Hub"]["detail"]  # conftest sets HF_HUB_OFFLINE=1
    assert str(tmp_path / "runs") in checks["disk"]["detail"]
    assert {"python", "torch / CUDA", "W&B"} <= checks.keys()


def test_table_output(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "lowmem-ft doctor" in out and "bitsandbytes 4-bit" in out and "training can run" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_require_gpu_without_one_fails_with_a_fix(capsys):
    rc, report = _json(capsys, "--require-gpu")
    gpu = next(c for c in report["checks"] if c["name"] == "GPU")
    assert rc == 2 and not report["can_train"]
    assert gpu["status"] == "fail" and "CUDA build of torch" in gpu["fix"]


def test_broken_4bit_kernel_fails(monkeypatch, capsys):
    import bitsandbytes as bnb

    # a backend whose dequantization disagrees with its matmul: an import check would pass, the real op does not
    monkeypatch.setattr(bnb.functional, "dequantize_4bit", lambda data, state: torch.zeros(64, 64))
    rc, report = _json(capsys)
    check = next(c for c in report["checks"] if c["name"] == "bitsandbytes 4-bit")
    assert rc == 2 and check["status"] == "fail"
    assert "off by" in check["detail"] and "model.quantization=none" in check["fix"]


def test_full_disk_fails(monkeypatch, capsys, tmp_path):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20))
    rc, report = _json(capsys, "--output-dir", str(tmp_path / "not" / "yet"))
    check = next(c for c in report["checks"] if c["name"] == "disk")
    assert rc == 2 and check["status"] == "fail" and "--output-dir" in check["fix"]


def test_hub_probe_gives_up_within_its_timeout(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # a TEST-NET-1 address (RFC 5737): never answers, so only the timeout ends the probe
    monkeypatch.setattr(constants, "ENDPOINT", "https://192.0.2.1")
    started = time.monotonic()
    check = doctor.check_hub()
    assert time.monotonic() - started < doctor.HUB_TIMEOUT_S + 1
    assert check.status == "warn" and "192.0.2.1 not reachable" in check.detail and "HF_HUB_OFFLINE" in check.fix


def test_doctor_names_the_checked_versions_and_warns_when_installed_differ(monkeypatch, capsys):
    from lowmem_ft import versions

    assert main(["doctor", "--json"]) == 0
    check = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["name"] == "library versions")
    assert check["status"] == "ok" and all(f"{n} {v}" in check["detail"] for n, v in versions.CHECKED.items())
    monkeypatch.setitem(versions.CHECKED, "transformers", "5.0.0")
    check = doctor.check_versions()
    assert check.status == doctor.WARN and "transformers" in check.detail and "(checked 5.0.0)" in check.detail
    assert "plan --verify" in check.fix


def test_calibrate_without_cuda_says_so_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: --calibrate measures it")
    assert main(["doctor", "--calibrate"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "doctor --calibrate measures a CUDA GPU and there is none here" in err


def test_calibrate_records_what_the_device_measured(monkeypatch, capsys, tmp_path):
    """On a simulated device, with the readings a GPU gave: each term beside the model's, recorded where the next
    `plan` reads it. (The readings themselves need a GPU: `lowmem_ft.train.measure.cuda_overheads.read`, run by the
    GPU kit.)"""
    from devkit.simulated_gpu import SimulatedGPU
    from lowmem_ft import calibrated
    from lowmem_ft.memory.calibration import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
    from lowmem_ft.train.measure import cuda_overheads

    # doctor sets the allocator up as `train` does (expandable segments unless the user chose): the user's here, so
    # the test leaves the environment as it found it, and the model's term is that setting's
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    monkeypatch.setattr("lowmem_ft.calibrated.calibration_dir", lambda: tmp_path)
    SimulatedGPU(name="NVIDIA H100 80GB HBM3").install(monkeypatch)
    readings = cuda_overheads.Readings(used=int(2.1e9), reserved=int(1.5e9), workspace=8 * 2**20,
                                       reserved_peak=int(1.5e9), allocated_peak=int(1.2e9), step_start=int(0.7e9))  # fmt: skip
    monkeypatch.setattr(cuda_overheads, "read", lambda: readings)
    allocator = cuda_overheads.model_allocator_bytes("expandable segments", readings)
    assert allocator > 0
    assert main(["doctor", "--calibrate", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured"] == {
        "CUDA context": 0.6e9,
        "cuBLAS workspaces": 8 * 2**20,
        "reserved over allocated": 0.3e9,
    }
    assert report["model"]["reserved over allocated"] == pytest.approx(allocator)
    # added: the context over the model's and the allocator's excess; the workspace measured below the model's
    assert CUBLAS_WORKSPACE_BYTES > 8 * 2**20
    added = (0.6e9 - CUDA_CONTEXT_BYTES) + (0.3e9 - allocator)
    assert report["added_gb"] == pytest.approx(added / 1e9)
    assert calibrated.for_this_device()[0] == pytest.approx(added / 1e9, abs=1e-3)
    assert report["file"] == str(tmp_path / "nvidia-h100-80gb-hbm3.json")
    assert main(["doctor", "--calibrate"]) == 0  # the table form; a second measurement is kept beside the first
    out = capsys.readouterr().out
    assert "reserved over allocated" in out and "2 measurements" in " ".join(out.split())


def test_doctor_says_what_this_gpu_is_calibrated_with(monkeypatch, tmp_path):
    from devkit.simulated_gpu import SimulatedGPU
    from lowmem_ft import calibrated

    assert doctor.check_calibration() == [] or torch.cuda.is_available()  # no NVIDIA GPU here: no row
    monkeypatch.setattr("lowmem_ft.calibrated.calibration_dir", lambda: tmp_path)
    SimulatedGPU(name="NVIDIA L40S").install(monkeypatch)
    (none,) = doctor.check_calibration()
    assert none.status == "ok" and none.detail == "none for NVIDIA L40S yet" and "doctor --calibrate" in none.fix
    key = calibrated.this_device()
    m = calibrated.Measurement("doctor", {"CUDA context": 0.7e9}, {"CUDA context": 0.5e9}, {}, {})
    calibrated.record(key, m)
    (found,) = doctor.check_calibration()
    assert found.status == "ok" and found.detail.startswith("calibrated on this GPU: +0.20 GB CUDA context")
    monkeypatch.setattr(
        "lowmem_ft.calibrated.this_device", lambda: calibrated.DeviceKey(**{**vars(key), "driver": "1"})
    )
    (stale,) = doctor.check_calibration()
    assert stale.status == "warn" and "ignored" in stale.detail and f"driver {key.driver} (now 1)" in stale.detail
