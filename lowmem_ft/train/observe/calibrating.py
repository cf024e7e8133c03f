"""Learning from every GPU run: the first steps' measured peaks beside the plan's, recorded as this GPU's calibration.

The monitor already samples at every phase boundary and resets the CUDA peaks at each sample, so each sample's
`peak_gb` (`max_memory_allocated`) and `peak_reserved_gb` (`max_memory_reserved`) belong to the phase that just ended.
`CalibrationRecorder` watches those samples for the first `STEPS` optimizer steps and, at the end of the last of
them, records one `lowmem_ft.calibrated.Measurement` for this device: each device-overhead term measured beside the
model's figure for the same plan (the estimate's `CUDA context` and allocator components), and each phase's
allocated and reserved peaks beside the prediction. What those terms are and how they are applied is
`lowmem_ft.calibrated`'s; here, only how a run's samples measure them:

- CUDA context: NVML's used bytes less `memory_reserved` at the run's first sample, before the first optimizer step
  creates any optimizer state (bitsandbytes' paged states live outside torch's allocator, and would count in after it).
  NVML's figure is the device's: another process on the same GPU counts in.
- reserved over allocated: in the sample (one phase of one step) that reserved most, its `max_memory_reserved`
  less its `max_memory_allocated`, against the estimate's allocator term; recorded with the allocator setting the
  run used (`lowmem_ft.cuda_alloc`), as it holds for that setting alone.
- cuBLAS workspaces: not measured by a run (the workspace is inside the allocated peak); `doctor --calibrate` is.

An observer like the monitor: it never acts on what it sees. Only rank 0 records (one writer per file); a run
on the CPU has no such samples and records nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from lowmem_ft.calibrated import GB, DeviceKey, Measurement, record
from lowmem_ft.cuda_alloc import run_setting
from lowmem_ft.memory.overheads import ALLOCATOR_PREFIX
from lowmem_ft.memory.records import Estimate

log = logging.getLogger(__name__)

STEPS = 3  # optimizer steps measured: the first creates the optimizer states, the next two run at steady state
# monitor phase → the estimate's phase (`Estimate.phases`) its peak is predicted by
PHASES = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}
# the estimate's component each measured term is compared with, by the start of its name (the allocator's names
# its setting: `lowmem_ft.memory.overheads.allocator_name`)
MODEL_TERMS = {"CUDA context": "CUDA context", "reserved over allocated": ALLOCATOR_PREFIX}


class CalibrationRecorder:
    """Watches a monitor's samples (`MemoryMonitor.watch`) and records this device's calibration once.

    Args:
        key: the device and software (`lowmem_ft.calibrated.this_device()`).
        estimate: the run's prediction (CUDA form: its components carry the device overheads).
        plan: what the run was, for the record (model, adapter, batch, length, VRAM target).
        steps: optimizer steps to measure; fewer when the run is shorter.
        context: measure the CUDA context; False for a resumed run, whose optimizer states are loaded before its
            first sample (bitsandbytes' paged states would count as context).
    """

    def __init__(self, key: DeviceKey, estimate: Estimate, plan: dict[str, Any], steps: int = STEPS,
                 context: bool = True):  # fmt: skip
        self.key, self.estimate, self.plan, self.steps = key, estimate, plan, max(1, steps)
        self.measure_context = context
        self.context: float | None = None
        self.peaks: dict[str, dict[str, float]] = {}
        self.top: tuple[float, float] = (0.0, 0.0)  # (reserved, allocated) peaks of the sample that reserved most
        self.measurement: Measurement | None = None
        self.done = False  # recorded, or tried and failed: once either way

    def watch(self, sample: dict[str, Any]) -> None:
        if self.done or "peak_reserved_gb" not in sample:  # done, or no CUDA figures
            return
        phase = sample.get("phase")
        if self.measure_context and self.context is None and "device_used_gb" in sample and not self.peaks:
            self.context = max(0.0, sample["device_used_gb"] - sample["reserved_gb"]) * GB
        if phase in PHASES:
            seen = self.peaks.setdefault(phase, {"allocated": 0.0, "reserved": 0.0})
            seen["allocated"] = max(seen["allocated"], sample["peak_gb"] * GB)
            seen["reserved"] = max(seen["reserved"], sample["peak_reserved_gb"] * GB)
            self.top = max(self.top, (sample["peak_reserved_gb"] * GB, sample["peak_gb"] * GB))
        if phase == "optimizer" and sample.get("step", 0) >= self.steps:
            self.finish()

    def measured(self) -> Measurement | None:
        """The measurement the samples so far make, or None before any train phase was seen."""
        if not self.peaks:
            return None
        by_name = self.estimate.by_name()
        predicted = self.estimate.phases  # a GRPO round's or a preference step's phases may be named otherwise
        phases = {
            name: {k: round(v) for k, v in seen.items()}
            | ({"predicted": round(predicted[PHASES[name]])} if PHASES[name] in predicted else {})
            for name, seen in self.peaks.items()
        }
        return Measurement(
            source="train",
            measured={"CUDA context": self.context, "reserved over allocated": self.top[0] - self.top[1]},
            model={term: sum(b for n, b in by_name.items() if n.startswith(c)) for term, c in MODEL_TERMS.items()},
            plan=self.plan | {"predicted_peak_gb": round(self.estimate.peak_gb, 3)},
            phases=phases,
            allocator=run_setting(),  # `train` configured the allocator from this environment before CUDA started
        )

    def finish(self) -> None:
        """Record what was measured (once); a failure is said, never raised: the run goes on without it."""
        if self.done:
            return
        self.done = True
        try:
            if (measurement := self.measured()) is None:
                return
            self.measurement = measurement
            path = record(self.key, measurement)
        except Exception as exc:  # an observer's failure must not end a GPU run (a full disk, a cache not writable)
            log.warning("could not record this GPU's calibration: %s", exc)
            return
        added = ", ".join(
            f"{t} {(e or 0) / GB:+.2f} GB" for t in MODEL_TERMS if (e := measurement.excess(t)) is not None
        )
        log.info("calibration of %s recorded in %s (measured over the model: %s)", self.key.device, path, added)
