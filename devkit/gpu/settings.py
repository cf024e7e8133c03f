"""The GPU check's limits as settings: what the device tool allows (what travels, one command's time) and how the
check spends it (its deadline, the reserve for the last report, each step's expected time).

The one idea: the lender's terms change (a 10-minute command, then 15 minutes of device time in all), so the limits
are fields with their reasons, not constants in the code that obeys them. `GpuSettings.from_env` reads an override of
any field from `LOWMEM_GPU_<FIELD>` (e.g. `LOWMEM_GPU_DEADLINE_S=300` for a shorter lease); `--deadline` on the
command line wins over both. Standard library only, as `devkit.gpu.kit` is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class StepTime:
    """A step's expected time on the H200: `fixed` seconds plus `per_billion` per billion parameters of its model
    (ESTIMATES until a device run records them: results.jsonl has each step's seconds)."""

    fixed: float
    per_billion: float = 0.0

    def seconds(self, params_b: float = 0.0) -> float:
        return self.fixed + self.per_billion * params_b


@dataclass(frozen=True)
class GpuSettings:
    # the device tool: the working tree that travels, carried paths included
    travel_bytes: int = 64 * 2**20
    # the device tool's limit on one command (gpu_check.sh is one command)
    command_s: int = 600
    # the check's steps end this long after gpu_check.sh starts: the command's limit less set-up (~15 s), the last
    # report and a margin for a rerun
    deadline_s: float = 450.0
    # kept back from the deadline for the last report
    reserve_s: float = 10.0
    probe: StepTime = StepTime(20)
    checkpoint: StepTime = StepTime(10, 2.5)
    point: StepTime = StepTime(15, 1.5)
    train: StepTime = StepTime(40, 3)
    context: StepTime = StepTime(40, 4)
    calibrate: StepTime = StepTime(30)  # doctor --calibrate: imports, CUDA start-up, a small Llama's six steps
    published: StepTime = StepTime(45)  # PEFT's loop: imports, Llama-3.2-3B made on the GPU, seven steps

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> GpuSettings:
        """The defaults with `LOWMEM_GPU_<FIELD>` overrides: a number for a limit, `FIXED` or `FIXED,PER_BILLION`
        for a step's time (`LOWMEM_GPU_TRAIN=60,4`)."""
        given = {}
        for f in fields(cls):
            text = env.get(f"LOWMEM_GPU_{f.name.upper()}")
            if text is None:
                continue
            try:
                if f.type == "StepTime":
                    given[f.name] = StepTime(*(float(x) for x in text.split(",")))
                else:
                    given[f.name] = (int if f.type == "int" else float)(text)
            except (TypeError, ValueError):
                raise SystemExit(f"LOWMEM_GPU_{f.name.upper()}={text!r}: expected {_expected(f.type)}") from None
        return replace(cls(), **given)


def _expected(kind: str) -> str:
    return {"int": "a whole number", "float": "a number"}.get(kind, "FIXED or FIXED,PER_BILLION seconds")


SETTINGS = GpuSettings.from_env()
