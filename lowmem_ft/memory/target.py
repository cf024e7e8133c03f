"""Where a run must fit: the VRAM of one device, the safety margin kept free under it, and the budget between them;
and the host RAM the run's processes may keep (the machine's, less a margin), when it is known.

The one idea: `budget_gb = vram_gb − margin_gb − calibration_gb` (and `host_budget_gb = host_ram_gb − host_margin_gb`) is computed
here and nowhere else. The planner fits its predicted
peak under the budget, the guard steps down when measured memory crosses it, and every file a run writes
(`plan.json`, `run.json`, `memory.jsonl`) means the same by `budget_gb`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    """A memory target: `vram_gb` per device (the `--vram` figure), `margin_gb` kept free, on `gpus` devices; and
    `host_ram_gb` of host RAM (`--host-ram`, else what the machine has available when planning — detected outside
    the memory model) with `host_margin_gb` kept free for the process itself, or None: host RAM is not a limit.
    `gpus` counts every device of the run, over its `nodes` machines; each machine's RAM holds its own share.
    `calibration_gb` is what this GPU's calibration adds to the margin (`lowmem_ft.calibrated`: never below zero, so
    never less than the recipe's margin) and `calibration` the line that says so, or why a stale one was ignored."""

    vram_gb: float
    margin_gb: float
    gpus: int = 1
    host_ram_gb: float | None = None
    host_margin_gb: float = 0.0
    nodes: int = 1
    calibration_gb: float = 0.0
    calibration: str = ""

    def __post_init__(self):
        if not self.calibration_gb >= 0:  # a calibration only adds (NaN refused too)
            raise ValueError(f"calibration_gb {self.calibration_gb} would lower the safety margin")

    @property
    def node_gpus(self) -> int:
        """The processes (one per device) that share one machine's host RAM: `gpus` over the `nodes`."""
        return max(1, self.gpus // self.nodes)

    @property
    def host_budget_gb(self) -> float:
        """Host RAM the processes of one machine may keep together (`node_gpus` of them): RAM less the margin."""
        return math.inf if self.host_ram_gb is None else self.host_ram_gb - self.host_margin_gb

    @property
    def budget_gb(self) -> float:
        """What a run may use: the VRAM less the safety margin (and what a calibration adds to it)."""
        return self.vram_gb - self.margin_gb - self.calibration_gb

    def to_dict(self) -> dict[str, Any]:
        return {
            "vram_gb": self.vram_gb,
            "safety_margin_gb": self.margin_gb,
            "budget_gb": round(self.budget_gb, 3),
            "gpus": self.gpus,
            **({"nodes": self.nodes} if self.nodes > 1 else {}),
            **({"calibration_gb": round(self.calibration_gb, 3)} if self.calibration_gb else {}),
            **({"calibration": self.calibration} if self.calibration else {}),
            **(
                {}
                if self.host_ram_gb is None
                else {
                    "host_ram_gb": round(self.host_ram_gb, 3),
                    "host_margin_gb": self.host_margin_gb,
                    "host_budget_gb": round(self.host_budget_gb, 3),
                }
            ),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Target | None:
        """The target a record describes, or None when it has no VRAM figure (a recipe used without --vram)."""
        if data.get("vram_gb") is None:
            return None
        host = data.get("host_ram_gb")
        return cls(
            float(data["vram_gb"]),
            float(data.get("safety_margin_gb") or 0.0),
            int(data.get("gpus") or 1),
            None if host is None else float(host),
            float(data.get("host_margin_gb") or 0.0),
            int(data.get("nodes") or 1),
            float(data.get("calibration_gb") or 0.0),
            str(data.get("calibration") or ""),
        )
