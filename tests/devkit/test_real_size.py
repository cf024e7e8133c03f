"""The real-size table's runner: the order rows are traced in, and the long row at the model's own positions."""

from __future__ import annotations

from devkit.bench import real_size
from lowmem_ft.memory.arch import catalog


def test_every_row_once_and_every_family_first_at_the_middle_tier():
    models = list(catalog())
    order = real_size.keys(models, [8.0, 24.0, 40.0], 16384)
    assert len(order) == len(set(order)) == len(models) * 3 * 2
    first = order[: 2 * len(real_size.FAMILY_FIRST)]
    assert first[:2] == ["Qwen/Qwen2.5-0.5B|24|", "Qwen/Qwen2.5-0.5B|24|16384"]
    assert {k.split("|")[0] for k in first} == set(real_size.FAMILY_FIRST)
    assert all(k.split("|")[1] == "24" for k in order[: len(models) * 2])


def test_a_family_without_a_plan_at_the_middle_tier_comes_next_at_the_largest():
    order = real_size.keys(["Qwen/Qwen2.5-0.5B", "mistralai/Mixtral-8x7B-v0.1"], [8.0, 24.0, 40.0], 16384)
    cache = {"mistralai/Mixtral-8x7B-v0.1|24|": {"plan": "no plan: needs 93.0 GB"}, "Qwen/Qwen2.5-0.5B|24|": {}}
    assert real_size._promoted(order, cache, 40.0) == ["mistralai/Mixtral-8x7B-v0.1|40|"]


def test_the_long_row_is_planned_at_the_models_positions_when_it_has_fewer():
    _, _, what = real_size._plan("microsoft/Phi-3-mini-4k-instruct", 24.0, 16384)
    assert "×4096" in what
