"""The training methods' registry: every recipe method has one `Method`, `--method` offers exactly those, and no
module of `train` outside `methods/` asks which method it runs."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import get_args

import pytest

from lowmem_ft.recipe.load import resolve
from lowmem_ft.recipe.schema import METHOD_INPUTS
from lowmem_ft.recipe.schema import Method as RecipeMethod
from lowmem_ft.train import methods

TRAIN = Path(__file__).resolve().parents[3] / "lowmem_ft" / "train"
# modules of train/ that may name a method: the methods themselves (the CPU yardstick reads the planning record)
MAY_NAME_METHODS = {"methods"}


def test_every_recipe_method_is_registered_under_its_name():
    assert methods.names() == get_args(RecipeMethod)
    for name in methods.names():
        method = methods.get(name)
        assert method.name == name
        for attribute in ("shown", "logged", "takes_rewards", "chunked_loss", "traced"):
            assert hasattr(method, attribute), (name, attribute)
        assert METHOD_INPUTS[name].rewards == method.takes_rewards, name  # the recipe's checks and the trainer agree
    with pytest.raises(KeyError, match="no training method 'ppo'; known: sft, dpo"):
        methods.get("ppo")


def test_method_flag_offers_the_registry():
    from lowmem_ft.commands import flags

    parser = argparse.ArgumentParser()
    flags.add_key_flags(parser, "--method")
    (action,) = [a for a in parser._actions if a.dest != "help"]
    assert tuple(action.choices) == methods.names()
    assert "sft, dpo, orpo, simpo, kto, grpo" in parser.format_help()


def test_each_method_keeps_its_own_figures():
    logs = {"loss": 0.7, "rewards/margins": 0.2, "log_odds_ratio": -0.5, "kl": 0.01, "reward": 0.5,
            "reward_std": 0.1, "completions/mean_length": 12.0, "clip_ratio/region_mean": 0.0, "entropy": 1.0,
            "mean_token_accuracy": 0.4}  # fmt: skip
    assert methods.own_figures(methods.get("sft"), logs) == {}
    assert methods.own_figures(methods.get("dpo"), logs) == {"rewards/margins": 0.2, "log_odds_ratio": -0.5, "kl": 0.01}
    assert methods.own_figures(methods.get("grpo"), logs) == {
        "rewards/margins": 0.2, "kl": 0.01, "reward": 0.5, "reward_std": 0.1, "completions/mean_length": 12.0,
        "clip_ratio/region_mean": 0.0,
    }  # fmt: skip


def test_grpo_says_its_round_on_the_banner_and_the_others_say_sequences():
    from lowmem_ft.choosing import Choice
    from lowmem_ft.train.observe.banner import RunView

    recipe = resolve("8gb", ["model.name_or_path=org/model", "training.method=grpo", "memory.micro_batch_size=4",
                             "memory.gradient_accumulation=2", "grpo.num_generations=4",
                             "grpo.max_completion_length=64"])  # fmt: skip
    batch = methods.get("grpo").batch_text(recipe, 2)
    text = "\n".join(RunView("grpo", recipe, Choice("recipe", "8gb", "org/model"), 1, 2, world_size=2,
                             batch=batch).lines())  # fmt: skip
    assert (
        "4 micro × 2 accumulation × 2 devices = 16 completions per step; a round generates 16 (4 prompts × 4), "
        "up to 64 tokens each"
    ) in text
    assert methods.get("sft").batch_text(recipe, 2) == methods.get("kto").batch_text(recipe, 2) == ""


def method_comparisons(source: str) -> list[int]:
    """Lines comparing something with a method's name (`method == "grpo"`, `method in ("dpo", "kto")`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            strings = {n.value for s in sides for n in ast.walk(s) if isinstance(n, ast.Constant)}
            named = any("method" in ast.unparse(s) for s in sides)
            if named and strings & set(methods.names()):
                found.append(node.lineno)
    return found


def test_no_module_of_train_outside_methods_branches_on_a_method():
    found = {}
    for path in TRAIN.rglob("*.py"):
        rel = path.relative_to(TRAIN).as_posix()
        if rel.split("/")[0] in MAY_NAME_METHODS or rel in MAY_NAME_METHODS:
            continue
        lines = method_comparisons(path.read_text(encoding="utf-8"))
        if lines:
            found[rel] = lines
    assert found == {}


def test_the_branch_check_sees_one():
    assert method_comparisons('if recipe.training.method != "sft":\n    pass\n') == [1]
    assert method_comparisons('if self.method in ("dpo", "kto"):\n    pass\n') == [1]
    assert method_comparisons('if kind == "sft":\n    pass\n') == []
