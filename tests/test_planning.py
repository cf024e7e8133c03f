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


# -- the model's positions and the VRAM target bound what is planned (issue #16) ---------------------------------
PHI3 = {"model": {"name_or_path": "microsoft/Phi-3-mini-4k-instruct"}}  # max_position_embeddings 4096 (catalog)


def test_a_long_sample_never_plans_beyond_the_models_positions():
    """Issue #16: one 5 MB line made the planner choose max_seq_len 984272. The data's p99 beyond the model's
    positions is capped there (longer samples follow data.truncate), and the reason says so."""
    from lowmem_ft.data.profile import LengthProfile

    profile = LengthProfile.from_lengths([200] * 50 + [984_272])
    recipe, choice = choose_recipe(vram_gb=80, recipe=None, overrides=PHI3, profile=profile)
    assert recipe.memory.max_seq_len == 4096
    why = choice.reasons["max_seq_len"]
    assert why.startswith("4096 tokens: the model's 4096 positions") and "p99 984272 is beyond them" in why
    assert "1 samples longer, 980176 tokens beyond it" in why


def test_a_capped_length_that_does_not_fit_is_shortened_further():
    from lowmem_ft.data.profile import LengthProfile

    profile = LengthProfile.from_lengths([100_000] * 10)  # Qwen-7B (v1): 8192 positions, ~1k tokens fit in 8 GB
    recipe, choice = choose_recipe(vram_gb=8, recipe=None, overrides={"model": {"name_or_path": "Qwen/Qwen-7B"}},
                                   profile=profile)  # fmt: skip
    assert 0 < recipe.memory.max_seq_len < 8192 and "the longest that fits" in choice.reasons["max_seq_len"]


def test_a_tier_length_beyond_the_positions_is_capped_and_an_asked_one_is_an_error():
    from dataclasses import replace

    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.planning import plan_setup

    arch = replace(load_architecture("Qwen/Qwen2.5-0.5B"), max_position_embeddings=1000)
    recipe = resolve("24gb", QWEN7)  # max_seq_len 2048
    planned = plan_setup(arch, recipe, Target(24, 1), frozenset())
    assert planned.setup.max_seq_len == 992  # 1000 rounded down to a multiple of 16
    assert planned.reasons["max_seq_len"] == "992 tokens: the recipe's 2048 capped at the model's 1000 positions"
    with pytest.raises(UserError, match=r"^--set memory.max_seq_len=2048: .* beyond the 1000 positions"):
        plan_setup(arch, recipe, Target(24, 1), frozenset({"max_seq_len"}))
    unknown = replace(arch, max_position_embeddings=0)  # not in the config: no bound
    assert plan_setup(unknown, recipe, Target(24, 1), frozenset()).setup.max_seq_len == 2048


@pytest.mark.parametrize("vram", [0.75, 0.5, 0.0])
def test_vram_must_leave_a_budget_above_the_margin(vram):
    with pytest.raises(UserError, match="0.75 GB safety margin .* smallest sensible --vram is 1.25"):
        choose_recipe(vram_gb=vram, recipe=None, overrides=QWEN7)
    for infinite in (float("inf"), float("nan")):
        with pytest.raises(UserError, match="not a finite number of GB"):
            choose_recipe(vram_gb=infinite, recipe=None, overrides=QWEN7)


def test_a_choice_record_with_figures_no_run_wrote_is_refused():
    for record in ({"vram_gb": float("inf")}, {"vram_gb": 8, "safety_margin_gb": 9}, {"vram_gb": "lots"},
                   {"vram_gb": 8, "predicted_peak_gb": "high"}):  # fmt: skip
        with pytest.raises((ValueError, TypeError)):
            Choice.from_dict(record)
    assert Choice.from_dict({"vram_gb": 8, "safety_margin_gb": 1}).target == Target(8, 1)
