"""devkit/bench/published_leads.py: the committed table is what its cache renders, and the cache holds the scans
the notes read (the LoRA row rising with the lead's length, full fine-tuning not)."""

from __future__ import annotations

import json
from pathlib import Path

from devkit.bench import published_leads as pl

TABLE = Path(__file__).resolve().parents[2] / "benchmarks" / "published_leads.md"


def test_the_committed_table_is_what_its_cache_renders():
    cache = json.loads(TABLE.with_suffix(".json").read_text())
    assert pl.render(cache) == TABLE.read_text()


def test_the_scans_cover_every_lead_and_differ_as_the_notes_say():
    rows = json.loads(TABLE.with_suffix(".json").read_text())["rows"]
    assert set(rows) == set(pl.COLUMNS)
    for row in rows.values():
        assert set(row["by_lead"]) == {str(lead) for lead in pl.LEADS}
    lora = [rows[pl.ROWS[0]]["by_lead"][str(lead)] for lead in pl.LEADS]
    assert lora == sorted(lora)  # rises with the length
    for name in (pl.FULL, f"{pl.FULL} descending"):
        full = [rows[name]["by_lead"][str(lead)] for lead in pl.LEADS]
        assert full != sorted(full)  # does not
