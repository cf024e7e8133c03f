"""devkit/gpu/calibration.py: the kit prints and returns every calibration the call recorded."""

from __future__ import annotations

import json

from devkit.gpu import calibration
from lowmem_ft import calibrated


def test_summary_prints_and_copies_each_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr("lowmem_ft.calibrated.calibration_dir", lambda: tmp_path / "cache")
    assert calibration.summary(tmp_path).startswith("calibration: none recorded")
    key = calibrated.DeviceKey("NVIDIA H200", "570.86", "2.13.0+cu130", "13.0", "0.50.2", "5.24.0")
    monkeypatch.setattr("lowmem_ft.calibrated.this_device", lambda: key)
    model = {"CUDA context": 0.5e9, "cuBLAS workspaces": 64 * 2**20, "reserved over allocated": 0.2e9}
    calibrated.record(key, calibrated.Measurement("doctor", {"CUDA context": 0.62e9, "cuBLAS workspaces": 0.0,
                                                             "reserved over allocated": 0.1e9}, model, {}, {}))  # fmt: skip
    calibrated.record(key, calibrated.Measurement("train", {"CUDA context": 0.55e9, "cuBLAS workspaces": None,
                                                            "reserved over allocated": 0.61e9}, model, {}, {}))  # fmt: skip
    text = calibration.summary(tmp_path)
    assert "calibration of NVIDIA H200 (driver 570.86, torch 2.13.0+cu130, CUDA 13.0):" in text
    assert "doctor" in text and "CUDA context 0.620 GB (model 0.500)" in text
    assert "train" in text and "reserved over allocated 0.610 GB (model 0.200)" in text
    # each term's largest excess: the doctor's context (+0.12), the run's reserved over allocated (+0.41)
    assert "calibrated on this GPU: +0.12 GB CUDA context, +0.41 GB reserved over allocated" in text
    assert calibrated.for_this_device()[0] == 0.53
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert len(saved) == 1 and len(saved[0]["measurements"]) == 2
