"""Where a run must fit: the VRAM of one device, the safety margin kept free under it, and the budget between them.

The one idea: `budget_gb = vram_gb − margin_gb` is computed here and nowhere else. The planner fits its predicted
peak under the budget, the guard steps down when measured memory crosses it, and every file a run writes
(`plan.json`, `run.json`, `memory.jsonl`) means the same by `budget_gb`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    """A memory target: `vram_gb` per device (the `--vram` figure), `margin_gb` kept free, on `gpus` devices."""

    vram_gb: float
    margin_gb: float
    gpus: int = 1

    @property
    def budget_gb(self) -> float:
        """What a run may use: the VRAM less the safety margin."""
        return self.vram_gb - self.margin_gb

    def to_dict(self) -> dict[str, Any]:
        return {
            "vram_gb": self.vram_gb,
            "safety_margin_gb": self.margin_gb,
            "budget_gb": round(self.budget_gb, 3),
            "gpus": self.gpus,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Target | None:
        """The target a record describes, or None when it has no VRAM figure (a recipe used without --vram)."""
        if data.get("vram_gb") is None:
            return None
        return cls(float(data["vram_gb"]), float(data.get("safety_margin_gb") or 0.0), int(data.get("gpus") or 1))
