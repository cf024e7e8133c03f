"""A run's memory log as read back (`RunDir.memory_log`): the start record, the samples and the events of the
monitor's JSON-lines file, tolerant of a line cut short by a crash and of the old meaning of `budget_gb`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class MemoryLog:
    """The records of a memory file: the start record (the latest, for a resumed run), samples and events.

    `start["budget_gb"]` is VRAM − margin; files written before that meaning (a `budget_gb` without `vram_gb`, when
    the field held the VRAM itself) are read in the current meaning. `unreadable` counts lines that are not JSON —
    the last line of a run that crashed while writing it.

    Predictions, one meaning each: `start["predicted_peak_gb"]` is the plan's peak on CUDA (overheads included; None
    without a plan); on the CPU, `start["predicted_cpu_peak_gb"]` and `start["predicted_cpu_phases_gb"]` are the
    memory model's CPU form (live tensor bytes) for the plan's batch `start["predicted_cpu_batch"]` ([rows,
    tokens]), and `start["exact"]` says the samples count live tensors exactly. A CPU sample's `live_gb` is live
    tensor bytes at the sample, `peak_live_gb` their exact peak since the previous sample, and
    `predicted_peak_live_gb` the memory model's prediction of that peak for the sample's phase and `batch` (the
    rows × tokens that ran); phases without one (save, eval) have none.
    """

    start: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    unreadable: int = 0

    @classmethod
    def read(cls, lines: Iterable[str], running: Callable[[], bool]) -> MemoryLog:
        """The records of a memory file's lines. Of a run still going (`running()`, asked only when a last line is
        cut), the whole lines written so far: a last line without its newline is the one the monitor is writing,
        neither a record nor damage; of a run that crashed, an unreadable line."""
        log = cls()
        going = None
        for line in lines:
            if not line.strip():
                continue
            if not line.endswith("\n"):  # the last line, cut: being written now, or by a run that crashed
                going = running() if going is None else going
                if going:
                    continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                record = None
            if not isinstance(record, dict):
                log.unreadable += 1
                continue
            if record.get("event") == "start":
                log.start = _start_record(record)
            elif "event" in record:
                log.events.append(record)
            else:
                log.samples.append(record)
        return log


def _start_record(record: dict[str, Any]) -> dict[str, Any]:
    if "vram_gb" not in record and record.get("budget_gb") is not None:  # the old meaning: budget_gb was the VRAM
        margin = record.get("safety_margin_gb") or 0.0
        record = {**record, "vram_gb": record["budget_gb"], "budget_gb": record["budget_gb"] - margin}
    return record
