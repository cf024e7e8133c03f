"""The device overheads (`lowmem_ft.memory.overheads`): the allocator's term by its setting, derived from the replays
that `devkit.bench.allocator_term` committed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.memory import calibration as cal
from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import estimate
from lowmem_ft.memory.overheads import ALLOCATOR_TERMS, allocator_name, device_overheads, transient_without_overheads
from lowmem_ft.memory.records import Setup

ROOT = Path(__file__).resolve().parents[2]
ARCH = load_architecture("Qwen/Qwen2.5-0.5B")


def test_the_constants_are_what_the_committed_replays_give():
    """Expandable segments' terms are `derive` over benchmarks/allocator_term.json (the largest seen, as committed);
    the default settings keep the assumed fraction, below what the same derivation gives (calibration says why)."""
    from devkit.bench.allocator_term import derive

    cache = json.loads((ROOT / "benchmarks" / "allocator_term.json").read_text())
    for full in (False, True):
        base, fraction, with_gradients = ALLOCATOR_TERMS["expandable segments", full]
        assert derive(cache, "expandable", full) == (base, fraction) and with_gradients
        assert base >= cal.ALLOCATOR_PAGE_BYTES
        assert ALLOCATOR_TERMS["default", full] == (0, cal.ALLOCATOR_FRACTION, False)
        assert derive(cache, "default", full)[1] > max(cal.ALLOCATOR_FRACTION, fraction)
    # the product's setting for adapters: well under the assumed 10 %
    assert ALLOCATOR_TERMS["expandable segments", False][1] < cal.ALLOCATOR_FRACTION / 2


@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("setting", ["expandable segments", "default"])
def test_the_plan_names_the_setting_and_prices_its_term(setting, adapter):
    s = Setup(quantization="none", adapter=adapter, optimizer="adamw_torch", allocator=setting, max_seq_len=512)
    est = estimate(ARCH, s)
    (component,) = [c for c in est.components if c.name.startswith("allocator (")]
    assert component.name == allocator_name(setting) == f"allocator ({setting.replace('default', 'default settings')})"
    base, fraction, with_gradients = ALLOCATOR_TERMS[setting, adapter == "full"]
    assert f"{fraction:.1%}" in component.source or f"{fraction:.0%}" in component.source
    # what it is a fraction of: the step's transient peak (plus, where derived so, the gradients, which every
    # optimizer step frees): more than the gradients, less than the whole live peak
    of = (component.bytes - base) / fraction
    gradients = est.by_name()["gradients"]
    assert (of > gradients) == with_gradients or adapter == "lora"
    assert of < est.model_peak_bytes - (0 if with_gradients else gradients)
    assert sum(c.bytes for c in est.components if c.phase == "overhead") == pytest.approx(est.overhead_bytes)


def test_the_overheads_taken_back_out_give_the_transient():
    for setting in ("expandable segments", "default"):
        s = Setup(allocator=setting)
        with_overheads = 3e9 + sum(c.bytes for c in device_overheads(s, 3e9))
        assert transient_without_overheads(s, with_overheads) == pytest.approx(3e9)
    assert transient_without_overheads(Setup(device="cpu"), 3e9) == 3e9
    assert device_overheads(Setup(device="cpu"), 3e9) == []
