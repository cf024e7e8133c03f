"""A GPU run's first steps become this GPU's calibration, which the next `plan` on it adds to its margin.

The whole loop on a simulated device (`devkit/simulated_gpu.py`: torch.cuda's memory calls and NVML answered by the
caching allocator's replay): the monitor's real `MemoryReader` samples it, `CalibrationRecorder` writes the file,
`lowmem-ft plan` finds the device through NVML and reads it back.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from devkit.simulated_gpu import SimulatedGPU
from lowmem_ft import calibrated
from lowmem_ft.choosing import choose_recipe
from lowmem_ft.cli import main
from lowmem_ft.train.observe.calibrating import STEPS, CalibrationRecorder

# imported before a device is simulated: transformers' Trainer imports bitsandbytes, whose CUDA backend would load
# when torch.cuda says a GPU is there
from lowmem_ft.train.observe.monitor import MemoryMonitor
from lowmem_ft.train.run import FineTune

MODEL = "Qwen/Qwen2.5-7B"  # the offline catalog's config: no download, no weights
MiB = 2**20


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr("lowmem_ft.calibrated.calibration_dir", lambda: tmp_path / "calibration")
    return tmp_path / "calibration"


def plan_json(capsys) -> dict:
    assert main(["plan", "--vram", "24", "--model", MODEL, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def a_run(tmp_path, gpu: SimulatedGPU, steps: int = STEPS) -> tuple[CalibrationRecorder, list[dict]]:
    """`steps` optimizer steps of a run planned for 24 GB on `gpu`, sampled by the monitor as a run samples them;
    the recorder watching. Returns it and the monitor's records."""
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides={"model": {"name_or_path": MODEL}})
    est = choice.plan.estimate
    monitor = MemoryMonitor(tmp_path / "memory.jsonl")  # the real reader: torch.cuda and NVML, both the device's
    recorder = CalibrationRecorder(calibrated.this_device(), est, {"model": MODEL}, steps)
    monitor.watch(recorder.watch)
    static = [gpu.malloc(int(est.phases["static"] / 64)) for _ in range(64)]  # weights, adapters, gradients
    layers = 28
    act = int((est.phases["backward"] - est.phases["static"]) / layers)
    states: list = []
    for step in range(steps):
        monitor.state = SimpleNamespace(global_step=step)  # the trainer's count: step + 1 is in progress
        # ragged activation sizes (one per layer) and transient buffers: reserved exceeds allocated, as on a GPU
        forward = [act - (i % 7) * 3 * MiB for i in range(layers)]
        gpu.step(monitor.sample, forward, [act // 3, 5 * MiB, act // 2], [] if states else [40 * MiB] * 4, states)
    monitor.close()
    del static
    return recorder, [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]


def test_a_run_on_a_gpu_calibrates_the_next_plan(tmp_path, cache, monkeypatch, capsys):
    gpu = SimulatedGPU(context_bytes=900 * 10**6).install(monkeypatch)
    before = plan_json(capsys)
    assert "calibration_gb" not in before  # nothing measured yet: the model alone

    recorder, records = a_run(tmp_path, gpu)
    m = recorder.measurement
    assert m is not None and list(cache.glob("*.json")) == [calibrated.calibration_file(calibrated.this_device())]
    # each term as the monitor's own records show it: NVML used − reserved at the first sample ...
    assert m.measured["CUDA context"] == pytest.approx(900e6, abs=1e4)
    # ... and reserved − allocated in the phase that reserved most, from the allocator replay's peaks
    top = max(records, key=lambda r: r["peak_reserved_gb"])
    assert m.measured["reserved over allocated"] == pytest.approx(
        (top["peak_reserved_gb"] - top["peak_gb"]) * 1e9, abs=1e4
    )
    assert m.measured["reserved over allocated"] > 0
    assert set(m.phases) == {"forward", "backward", "optimizer"}
    assert all(p["reserved"] >= p["allocated"] > 0 for p in m.phases.values())

    after = plan_json(capsys)
    added = sum(max(0.0, m.excess(t) or 0.0) for t in calibrated.TERMS) / 1e9
    assert added > 0.39  # the context alone measured 0.4 GB over the model's
    assert after["calibration_gb"] == pytest.approx(added, abs=1e-3)
    assert after["budget_gb"] == pytest.approx(before["budget_gb"] - added, abs=2e-3)
    assert after["safety_margin_gb"] == before["safety_margin_gb"]  # the recipe's margin stands; the calibration adds
    assert after["predicted_peak_gb"] <= after["budget_gb"]
    why = after["reasons"]["safety_margin_gb"]
    assert f"+{(m.excess('CUDA context') or 0) / 1e9:.2f} GB CUDA context" in why and "calibrated on this GPU" in why

    assert main(["plan", "--vram", "24", "--model", MODEL]) == 0  # the table says it too
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    margin = before["safety_margin_gb"]
    assert f"{after['budget_gb']:.2f}" in out and "calibrated" in out.split("budget (VRAM − margin)")[1][:60]
    assert f"safety_margin_gb: {margin:g} GB (memory.safety_margin_gb) + {added:.2f} GB; calibrated on this GPU" in out


def test_a_calibration_never_lowers_the_margin(tmp_path, cache, monkeypatch, capsys):
    gpu = SimulatedGPU(context_bytes=100 * 10**6, allocator=calibrated_nothing()).install(monkeypatch)
    before = plan_json(capsys)
    recorder, _ = a_run(tmp_path, gpu)
    assert (recorder.measurement.excess("CUDA context") or 0) < 0  # measured below the model's
    after = plan_json(capsys)
    assert after["budget_gb"] == before["budget_gb"] and "calibration_gb" not in after
    assert "nothing added" in after["reasons"]["safety_margin_gb"]


def calibrated_nothing():
    """An allocator whose every request is a whole 2 MiB multiple of its own: reserved never exceeds allocated by
    more than the model's allocator term."""
    from lowmem_ft.train.measure.allocator import Allocator

    return Allocator(expandable_segments=True)


def test_a_stale_calibration_is_ignored_and_said(tmp_path, cache, monkeypatch, capsys):
    gpu = SimulatedGPU(context_bytes=900 * 10**6).install(monkeypatch)
    before = plan_json(capsys)
    a_run(tmp_path, gpu)
    path = calibrated.calibration_file(calibrated.this_device())
    data = json.loads(path.read_text())
    data["device"]["torch"] = "2.0.0"
    path.write_text(json.dumps(data))
    after = plan_json(capsys)
    assert after["budget_gb"] == before["budget_gb"] and "calibration_gb" not in after
    why = after["reasons"]["safety_margin_gb"]
    assert "ignored" in why and "torch 2.0.0 (now " in why
    # the next run replaces it
    a_run(tmp_path, gpu)
    assert json.loads(path.read_text())["device"]["torch"] != "2.0.0"
    assert plan_json(capsys)["calibration_gb"] > 0


def test_the_recorder_measures_the_first_steps_only(tmp_path, cache, monkeypatch):
    gpu = SimulatedGPU().install(monkeypatch)
    recorder, records = a_run(tmp_path, gpu, steps=1)
    assert recorder.measurement is not None
    phases = recorder.measurement.phases  # measured beside predicted, for the record
    assert phases["forward"]["predicted"] == round(recorder.estimate.phases["forward"])
    assert phases["optimizer"]["predicted"] == round(recorder.estimate.phases["optimizer step"])
    assert phases["forward"]["allocated"] == max(r["peak_gb"] for r in records if r["phase"] == "forward") * 1e9
    kept = json.loads(next(cache.glob("*.json")).read_text())["measurements"]
    assert len(kept) == 1 and kept[0]["plan"]["model"] == MODEL and kept[0]["when"]
    # a sample without CUDA figures (a CPU run) measures nothing
    cpu = CalibrationRecorder(recorder.key, recorder.estimate, {}, 1)
    cpu.watch({"step": 1, "phase": "optimizer", "rss_gb": 1.0})
    assert cpu.measured() is None and cpu.measurement is None
    # a resumed run measures no context: its optimizer states were loaded before its first sample
    resumed = CalibrationRecorder(recorder.key, recorder.estimate, {}, 1, context=False)
    resumed.watch({"step": 1, "phase": "forward", "peak_gb": 2.0, "peak_reserved_gb": 2.5, "reserved_gb": 2.5,
                   "device_used_gb": 4.0})  # fmt: skip
    resumed.watch({"step": 1, "phase": "optimizer", "peak_gb": 2.0, "peak_reserved_gb": 2.1, "reserved_gb": 2.1})
    assert resumed.measurement.measured == {"CUDA context": None, "reserved over allocated": pytest.approx(0.5e9)}
    assert resumed.measurement.excess("CUDA context") is None
    # phases the estimate names otherwise (a GRPO round's) are recorded without a prediction; a failure to record
    # is a warning, once, never an error in the run
    grpo = CalibrationRecorder(recorder.key, recorder.estimate, {}, 1)
    grpo.estimate = SimpleNamespace(phases={"generation": 1.0}, by_name=dict, peak_gb=1.0)
    monkeypatch.setattr(
        "lowmem_ft.train.observe.calibrating.record", lambda *a: (_ for _ in ()).throw(OSError(28, "full"))
    )
    grpo.watch({"step": 1, "phase": "optimizer", "peak_gb": 2.0, "peak_reserved_gb": 2.1, "reserved_gb": 2.1})
    assert grpo.done and grpo.measurement.phases == {"optimizer": {"allocated": 2e9, "reserved": 2.1e9}}


def test_without_a_gpu_there_is_nothing_to_calibrate(cache, monkeypatch, capsys):
    monkeypatch.setattr("lowmem_ft.calibrated.this_device", lambda: None)
    assert calibrated.for_this_device() == (0.0, "")
    assert "calibration_gb" not in plan_json(capsys)


def test_the_target_takes_a_calibration_only_as_an_addition():
    from lowmem_ft.memory.target import Target

    t = Target(24, 1.5, calibration_gb=0.41, calibration="calibrated on this GPU: +0.41 GB CUDA context")
    assert t.budget_gb == pytest.approx(22.09) and Target.from_dict(t.to_dict()) == t  # run.json keeps it
    with pytest.raises(ValueError, match="would lower the safety margin"):
        Target(24, 1.5, calibration_gb=-0.2)


def test_a_run_on_a_gpu_watches_its_first_steps(tmp_path, cache, monkeypatch):
    """`FineTune` subscribes the recorder to its monitor on a GPU: with its plan's estimate, or (resumed, or no
    --vram) the same prediction made from the recipe; a resumed run measures no context."""
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides={"model": {"name_or_path": MODEL}})
    SimulatedGPU().install(monkeypatch)
    for plan, checkpoint in ((choice.plan, None), (None, tmp_path / "checkpoint-2")):
        monitor = MemoryMonitor(tmp_path / "memory.jsonl", write=False)
        run = SimpleNamespace(recipe=recipe, choice=SimpleNamespace(plan=plan), target=choice.target,
                              args=SimpleNamespace(max_steps=2), checkpoint=checkpoint, monitor=monitor)  # fmt: skip
        FineTune._watch_calibration(run)
        (watch,) = monitor._watchers
        recorder = watch.__self__
        assert recorder.key == calibrated.this_device() and recorder.steps == 2
        assert recorder.measure_context is (checkpoint is None)
        assert recorder.plan["model"] == MODEL and recorder.plan["vram_gb"] == 24
        assert recorder.estimate.peak_gb == pytest.approx(choice.plan.estimate.peak_gb, rel=0.05)


def test_generate_and_eval_keep_a_calibration_off_the_gpu_too(cache, monkeypatch, capsys):
    """`generate` / `eval` bound their lengths and batch by the same reserve as the planner: margin + this GPU's
    calibration + the CUDA context, saying so when a calibration is added."""
    from lowmem_ft.commands.generate import reserve_bytes
    from lowmem_ft.memory.estimate import CUDA_CONTEXT_BYTES, GB

    monkeypatch.setattr("lowmem_ft.calibrated.this_device", lambda: None)
    assert reserve_bytes(1.0) == int(1.0 * GB + CUDA_CONTEXT_BYTES)
    assert capsys.readouterr().err == ""
    key = calibrated.DeviceKey("NVIDIA L4", "570.86", "2.13.0+cu130", "13.0", "0.50.2", "5.24.0")
    monkeypatch.setattr("lowmem_ft.calibrated.this_device", lambda: key)
    model = {"CUDA context": 0.5e9, "reserved over allocated": 0.2e9}
    calibrated.record(key, calibrated.Measurement("train", {"CUDA context": 0.5e9, "reserved over allocated": 0.45e9},
                                                  model, {}, {}))  # fmt: skip
    assert reserve_bytes(1.0) == int(1.25 * GB + CUDA_CONTEXT_BYTES)
    assert "calibrated on this GPU: +0.25 GB reserved over allocated" in capsys.readouterr().err


def test_the_allocator_term_is_kept_for_the_setting_it_was_measured_under(tmp_path, cache, monkeypatch, capsys):
    """A run under torch's default allocator settings (the user's own PYTORCH_CUDA_ALLOC_CONF) strands other blocks
    than one under expandable segments: its reserved-over-allocated excess calibrates plans for that setting only.
    The context, a property of the device, holds for both."""
    gpu = SimulatedGPU(context_bytes=900 * 10**6).install(monkeypatch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    recorder, _ = a_run(tmp_path, gpu)
    assert recorder.measurement.allocator == "default"  # the run says which setting it measured
    key = calibrated.this_device()
    calibrated.calibration_file(key).unlink()
    model = {"CUDA context": 0.5e9, "reserved over allocated": 0.2e9}
    measured = {"CUDA context": 0.6e9, "reserved over allocated": 0.5e9}
    calibrated.record(key, calibrated.Measurement("train", measured, model, {}, {}, allocator="default"))
    default = plan_json(capsys)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")  # the plan of a run that sets expandable segments itself
    expandable = plan_json(capsys)
    assert default["calibration_gb"] == pytest.approx(0.4) and expandable["calibration_gb"] == pytest.approx(0.1)
    said = expandable["reasons"]["safety_margin_gb"]
    assert "+0.10 GB CUDA context" in said and "+0.30 GB" not in said
    assert "reserved over allocated was measured only under another allocator setting than this run's (expandable " \
           "segments): not applied" in " ".join(said.split())  # fmt: skip
    assert "+0.30 GB reserved over allocated (default)" in default["reasons"]["safety_margin_gb"]
    # measured under expandable segments too: each setting takes its own
    measured = {"CUDA context": 0.5e9, "reserved over allocated": 0.3e9}
    calibrated.record(key, calibrated.Measurement("train", measured, model, {}, {}, allocator="expandable segments"))
    assert plan_json(capsys)["calibration_gb"] == pytest.approx(0.2)

    # a file written before the setting was recorded: its measurements count for either setting (a calibration adds)
    path = calibrated.calibration_file(key)
    data = json.loads(path.read_text())
    for entry in data["measurements"]:
        del entry["allocator"]
    path.write_text(json.dumps(data))
    assert plan_json(capsys)["calibration_gb"] == pytest.approx(0.4)
