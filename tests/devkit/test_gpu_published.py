"""The GPU check's `published` step (`devkit.gpu.published`): PEFT's loop run for real, its record and report."""

from __future__ import annotations

import pytest

from devkit.gpu import published
from devkit.harness import peft_metamathqa as pub


@pytest.mark.parametrize("setting", ["default", "expandable"])
def test_the_step_runs_the_publishers_sequence_and_records_every_reading(setting):
    """On the CPU (the smoke) the loop runs the harness's sequence at short lengths: one reading per step, the
    predictions kept only where they apply (torch's default settings, on a GPU)."""
    record = published.measure(published.LORA, setting, smoke=True)
    seq, _ = pub.lead_sequence(pub.newest(published.LORA), published.SMOKE_LENGTHS)
    assert len(record["lengths"]) == len(seq) == len(record["reserved"]) == len(record["allocated"])
    assert record["lengths"][published.LEADS["first"]] == max(published.SMOKE_LENGTHS)
    assert record["device"] == "cpu" and record["predicted"] == {} and record["allocator"] == setting


def test_the_report_sets_the_readings_against_the_replay_and_the_published_max():
    name = published.LORA
    result = pub.newest(name)
    gb = 1e9
    record = {
        "kind": "published", "name": name, "label": result.label, "allocator": "default", "device": "cuda",
        "libraries": "t / t / p", "lengths": [208, 96, 704, 208, 96, 599, 208],
        "reserved": [10 * gb, 9 * gb, 22 * gb, 11 * gb, 9 * gb, 20 * gb, 12 * gb],
        "allocated": [7 * gb] * 6 + [6.9 * gb], "max_reserved": 22.5 * gb, "max_allocated": 21 * gb,
        "predicted": {"first": 22.41 * gb, "second": 20.13 * gb, "allocated": 6.88 * gb},
        "published": {"max": result.max_reserved, "p99": result.reserved_p99, "gpu": "L40S"},
    }  # fmt: skip
    (row,) = [line for line in published.section([record, {"kind": "step"}]) if line.startswith(f"| {result.label}")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4:10] == ["22.00", "22.41", "+1.86%", "20.00", "20.13", "+0.65%"]
    assert cells[10:12] == ["6.90", "6.88"]
    assert cells[12] == "22.50" and cells[14] == f"{(22.5 * gb - result.max_reserved) / result.max_reserved:+.2%}"
    assert published.section([{"kind": "step"}]) == []
