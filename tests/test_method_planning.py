"""How each method is planned: one record per recipe method, and a paired method's rows and samples agree with the
memory model's."""

from __future__ import annotations

from typing import get_args

import pytest

from lowmem_ft.memory.preference import WITH_REFERENCE, rows_per_micro_batch
from lowmem_ft.memory.records import Setup
from lowmem_ft.method_planning import PLANNING, planning
from lowmem_ft.recipe.schema import METHOD_INPUTS, Method


def test_every_recipe_method_has_its_planning():
    assert tuple(PLANNING) == get_args(Method)
    assert all(planning(name).name == name for name in PLANNING)


def test_every_recipe_method_has_its_inputs_and_they_agree_with_the_memory_model():
    """What the recipe says of a method (its data, a reference) and how it is planned describe the same step."""
    assert tuple(METHOD_INPUTS) == get_args(Method)
    assert {name for name, inputs in METHOD_INPUTS.items() if inputs.reference} == set(WITH_REFERENCE)
    for name, inputs in METHOD_INPUTS.items():
        assert planning(name).preference_step == (inputs.data_format in ("preference", "kto")), name
        assert planning(name).rounds == (inputs.data_format == "prompts"), name


@pytest.mark.parametrize("name", ["dpo", "orpo", "simpo", "kto"])
def test_a_preference_method_plans_rows_and_gives_back_samples(name):
    method = planning(name)
    rows = rows_per_micro_batch(name, 3)
    assert method.setup(Setup(micro_batch_size=3)).micro_batch_size == rows
    assert method.samples(rows) == 3
    assert method.trainer_loss and method.lowers_length and not method.rounds


def test_sft_is_planned_as_it_is_and_grpo_by_rounds():
    s = Setup(micro_batch_size=4, lora_dropout=0.05)
    assert planning("sft").setup(s) == s and not planning("sft").trainer_loss
    grpo = planning("grpo")
    assert grpo.rounds and grpo.trainer_loss and grpo.setup(s).lora_dropout == 0.0 and grpo.samples(4) == 4
