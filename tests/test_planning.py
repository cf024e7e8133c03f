"""Choosing a run's recipe: tiers, the recipe ⇄ setup mapping, plans applied back, and the record of the choice."""

from __future__ import annotations

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.memory.target import Target
from lowmem_ft.planning import (
    Choice,
    apply_plan,
    choose_recipe,
    fixed_knobs,
    setup_from_recipe,
    start_recipe,
    tier_for_vram,
)
from lowmem_ft.recipe.load import resolve

QWEN7 = {"model": {"name_or_path": "Qwen/Qwen2.5-7B"}}


@pytest.mark.parametrize(("vram", "tier"), [(8, "8gb"), (12, "8gb"), (24, "24gb"), (39.5, "24gb"), (80, "40gb")])
def test_tier_is_the_largest_not_above_the_target(vram, tier):
    assert tier_for_vram(vram) == tier


def test_no_tier_below_the_smallest():
    with pytest.raises(UserError, match="no recipe tier fits"):
        tier_for_vram(4)


def test_choose_needs_a_target_or_a_recipe():
    with pytest.raises(UserError, match="--vram"):
        choose_recipe(vram_gb=None, recipe=None, overrides={})


def test_fixed_knobs_are_the_planners_names_of_the_keys_set():
    overrides = {"model": {"quantization": "nf4", "name_or_path": "x"}, "memory": {"chunked_loss": True,
                 "gradient_accumulation": 2}, "training": {"max_steps": 5}}  # fmt: skip
    assert fixed_knobs(overrides) == {"quantization", "loss_impl", "gradient_accumulation"}


def test_planned_recipe_carries_the_plan_and_keeps_everything_else():
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides={**QWEN7, "training": {"max_steps": 7}})
    p = choice.plan
    assert choice.how == "plan" and choice.recipe == "24gb" and choice.model == "Qwen/Qwen2.5-7B"
    assert recipe.training.max_steps == 7 and recipe.adapter.r == resolve("24gb").adapter.r
    assert setup_from_recipe(recipe) == p.setup
    assert recipe.memory.gradient_accumulation == p.gradient_accumulation
    assert recipe.memory.eval_batch_size == p.eval_batch_size
    assert apply_plan(recipe, p) == recipe


def test_choice_means_one_thing_per_field_and_round_trips():
    _, choice = choose_recipe(vram_gb=24, recipe=None, overrides=QWEN7)
    record = choice.to_dict()
    assert record["vram_gb"] == 24 and record["safety_margin_gb"] == 1.5 and record["budget_gb"] == 22.5
    assert record["predicted_peak_gb"] <= record["budget_gb"] and record["fits"] is True
    again = Choice.from_dict(record)
    assert again == choice and again.plan is None and again.target == Target(24, 1.5)
    assert again.resumed("runs/x/recipe.yaml").how == "resume"
    plan_record = choice.plan_record(resolve("24gb", QWEN7))
    assert plan_record["budget_gb"] == 22.5 and plan_record["model"] == "Qwen/Qwen2.5-7B" and "recipe" in plan_record


def test_without_vram_the_recipe_is_used_as_given():
    recipe, choice = choose_recipe(vram_gb=None, recipe="24gb", overrides=QWEN7)
    assert recipe == resolve("24gb", QWEN7)
    assert choice.how == "recipe" and choice.target is None and choice.to_dict()["vram_gb"] is None


def test_full_finetune_from_a_qlora_tier_plans_16bit_storage():
    """`--set adapter.kind=full` on a 4-bit tier used to stop with 'full cannot train nf4-quantized weights'."""
    overrides = {"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}, "adapter": {"kind": "full"}}
    assert start_recipe(24, None, overrides).model.quantization == "none"
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides=overrides)
    assert recipe.adapter.kind == "full" and recipe.model.quantization == "none" and choice.fits
    assert "full fine-tuning" in choice.reasons["quantization"]
    # a quantization the user fixed too is theirs: the recipe's rule still applies
    with pytest.raises(UserError, match="full cannot train nf4"):
        choose_recipe(vram_gb=24, recipe=None, overrides={**overrides, "model": {**overrides["model"],
                      "quantization": "nf4"}})  # fmt: skip


def test_seq_len_fixes_the_length_and_is_named_in_errors():
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides=QWEN7, seq_len=4096)
    assert recipe.memory.max_seq_len == 4096 and choice.reasons["max_seq_len"] == "4096 tokens, as --seq-len asked"
    with pytest.raises(UserError, match="^--seq-len: 'memory.max_seq_len' must be at least 16"):
        choose_recipe(vram_gb=24, recipe=None, overrides=QWEN7, seq_len=8)
