"""devkit/bench/published_throughput.py: every `COST` factor is set beside a published figure or said to have none,
and the committed table is what the module prints now."""

from __future__ import annotations

from pathlib import Path

import pytest

from devkit.bench import published_throughput as pt
from lowmem_ft.memory.planner import COST

ROOT = Path(__file__).resolve().parents[2]


def test_every_cost_factor_has_a_row():
    text = pt.table()
    for name in COST:
        rows = [line for line in text.splitlines() if line.startswith(f"| {name}")]
        assert len(rows) == 1, name
        assert "none found" in rows[0] or "litgpt" in rows[0] or "perf_train_gpu_one" in rows[0], rows[0]


def test_the_published_ratios_are_read_from_the_sources():
    # LitGPT, Llama 2 7B, LoRA at micro batch 1: 3.83 min (nf4-dq) over 2.36 min (16-bit) per 1k iterations
    assert dict(pt.nf4_rows())["Llama 2 7 B"] == pytest.approx(3.83 / 2.36)
    # PEFT: DoRA r32 against LoRA r32 of the same generation (torch 2.13, empty_cache every 10 steps)
    rows = {(label, gen): ratio for label, gen, _, ratio in pt.peft_rows()}
    assert rows[("dora r32 q,v", "torch 2.13.0+cu130, empty_cache every 10")] == pytest.approx(1190.907 / 941.959, 1e-4)
    assert rows[("lora r10 mlp", "torch 2.9.0+cu128, empty_cache every 1")] is None  # no LoRA r32 of that generation
    # transformers' single-GPU guide: 1 × 4 accumulated with checkpointing 85.47 s, without 66.03 s
    assert pt.checkpointing_ratio() == pytest.approx(85.47 / 66.03)


def test_the_committed_table_is_current():
    assert (ROOT / "benchmarks" / "published_throughput.md").read_text() == pt.table()
