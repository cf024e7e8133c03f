"""Every recipe key, walked through what is derived from its one declaration (`lowmem_ft.recipe.schema.KEYS`): its
flag on the command line ↔ the recipe ↔ the planner's `Setup` (or request) ↔ the plan applied back, with the
schema's defaults as the one set of defaults and errors naming where a value came from."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from typing import Literal, get_args, get_origin

import pytest

from lowmem_ft.choosing import (
    BESIDE_SETUP,
    RECIPE_KNOBS,
    SETUP_FIELDS,
    apply_plan,
    asked,
    origin_of,
    request_for,
)
from lowmem_ft.cli import build_parser
from lowmem_ft.commands.flags import FLAG_KEYS
from lowmem_ft.commands.train import request_of
from lowmem_ft.errors import ConfigError, UserError
from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import Setup
from lowmem_ft.memory.planner import check
from lowmem_ft.memory.target import Target
from lowmem_ft.recipe.load import resolve
from lowmem_ft.recipe.schema import KEYS, Key, Recipe

PLANNED = [key for key in KEYS.values() if key.planned is not None]
FLAGGED = [key for key in KEYS.values() if key.flag is not None]
# `Setup` fields no recipe key feeds: the device is the command's (CPU for the estimator's harnesses), the allocator
# setting the environment's (lowmem_ft.cuda_alloc), LoRA in the compute dtype the strategy's (FSDP mixed precision),
# and the labelled positions and image patches of a batch are known only from the data or the batch itself.
NOT_FROM_A_RECIPE = {"device", "allocator", "loss_tokens", "image_patches", "batch_patches", "lora_in_compute_dtype"}
ARCH = load_architecture("Qwen/Qwen2.5-0.5B")  # offline catalog: its loss is reproduced by the chunked loss


def other_value(key: Key):
    """A value of `key` other than its default, of its declared type (not necessarily valid with the others)."""
    tp, default = key.type, key.default
    if key.path == "adapter.init":  # a pattern (pissa_niter_N), not a Literal
        return "gaussian"
    if get_origin(tp) is Literal:
        return next(c for c in get_args(tp) if c != default)
    if tp is bool:
        return not default
    if tp is int:
        return default + 32 if default > 0 else 64  # a positive count, and a multiple of 16 for lengths
    if tp is float:
        return round(default / 2, 6) if default else 0.25  # within [0, 1) and above 0 where those are the ranges
    if get_origin(tp) is list:
        (inner,) = get_args(tp)
        if get_origin(inner) is dict:  # data.mix
            return [{"path": "a.jsonl", "weight": 2}]
        if key.path == "grpo.rewards":  # reward names: a built-in's (lowmem_ft.recipe.rewards)
            return ["exact_match:2"]
        return [next(c for c in get_args(inner) if c not in default)] if get_origin(inner) is Literal else ["q_proj"]
    if get_origin(tp) is dict:
        return {"prompt": "question"}
    return "x-" + (default or "value")


def with_value(recipe: Recipe, key: Key, value) -> Recipe:
    return replace(recipe, **{key.section: replace(getattr(recipe, key.section), **{key.name: value})})


# -- one set of defaults ------------------------------------------------------------------------------------------
def test_every_setup_field_is_fed_by_a_recipe_key_or_named_here():
    fed = set(RECIPE_KNOBS.values())
    assert {f.name for f in fields(Setup)} - fed == NOT_FROM_A_RECIPE
    assert fed - SETUP_FIELDS == {"eval_batch_size"}  # carried by the request and the plan beside the setup
    assert BESIDE_SETUP & fed == {"gradient_accumulation", "eval_batch_size"}


@pytest.mark.parametrize("key", PLANNED, ids=lambda k: k.path)
def test_the_planner_gets_the_schemas_default(key):
    """The schema's default is what the planner starts from (`setup_from_recipe` fills every mapped field)."""
    name, wanted = key.planned.name, key.planned.to_planner(key.default)
    request = request_for(Recipe(), Target(24.0, 1.0))
    got = getattr(request.start, name) if name in SETUP_FIELDS else getattr(request, name)
    assert got == wanted
    if name in BESIDE_SETUP and name in SETUP_FIELDS:
        assert getattr(request, name) == wanted


def test_the_shipped_base_recipe_is_the_schemas_defaults():
    assert resolve("base") == Recipe()


@pytest.mark.parametrize("key", [k for k in PLANNED if k.planned.name in SETUP_FIELDS], ids=lambda k: k.path)
def test_setups_own_default_is_the_schemas(key):
    """One set of defaults: a `Setup` built without a recipe starts where the schema does (gradient_accumulation
    was 1 in `Setup`, 8 in the schema). A schema default of 0 meaning "none" maps to the planner's None."""
    assert getattr(Setup(), key.planned.name) == key.planned.to_planner(key.default)


@pytest.mark.parametrize("key", list(KEYS.values()), ids=lambda k: k.path)
def test_every_key_is_set_on_the_command_line_and_reaches_the_planner_when_it_feeds_it(key):
    """Every key, flag or not: `--set key=value` → the recipe → (for a planned key) the setup and back."""
    value = other_value(key)
    argv = ["--set", f"{key.path}={json.dumps(value)}"]
    if key.path == "adapter.kind":  # full fine-tuning trains 16-bit weights
        argv += ["--set", "model.quantization=none"]
    request = request_of(_train(*argv))
    if key.path == "grpo.use_vllm":  # declared so that asking for it is refused in one line saying why
        with pytest.raises(UserError, match="vLLM 0.22-0.31, which require transformers < 5.18"):
            resolve(None, request.overrides, request.origins)
        return
    recipe = resolve(None, request.overrides, request.origins)
    assert key.of(recipe) == value != key.default
    others = [k for k in KEYS.values() if k is not key and k.path != "model.quantization"]
    assert all(k.of(recipe) == k.default for k in others)  # the one key, nothing else
    if key.planned is not None:
        plan = check(ARCH, request_for(recipe, Target(80.0, 1.0)))
        assert key.of(apply_plan(Recipe(), plan)) == value


# -- recipe ↔ Setup ↔ plan ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", PLANNED, ids=lambda k: k.path)
def test_each_planned_key_reaches_the_setup_and_comes_back_from_the_plan(key):
    value = other_value(key)
    recipe = with_value(Recipe(), key, value)
    if key.path == "adapter.kind":  # full fine-tuning trains 16-bit weights
        recipe = with_value(recipe, KEYS["model.quantization"], "none")
    request = request_for(recipe, Target(80.0, 1.0))
    name = key.planned.name
    got = getattr(request.start, name) if name in SETUP_FIELDS else getattr(request, name)
    assert got == key.planned.to_planner(value) != key.planned.to_planner(key.default)
    plan = check(ARCH, request)  # the plan of the setup as given: nothing changed by a search
    assert apply_plan(recipe, plan) == recipe
    assert key.of(apply_plan(Recipe(), plan)) == value  # the plan's value is the one applied


def test_the_plans_own_figures_are_applied_over_its_setups():
    plan = check(ARCH, request_for(Recipe(), Target(80.0, 1.0)))
    plan = replace(plan, gradient_accumulation=3, eval_batch_size=5)
    memory = apply_plan(Recipe(), plan).memory
    assert (memory.gradient_accumulation, memory.eval_batch_size) == (3, 5)


# -- the command line ---------------------------------------------------------------------------------------------
def _train(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def _flag_argv(key: Key, value) -> list[str]:
    if key.flag.switch is not None:
        return [key.flag.name]
    return [key.flag.name, *(map(str, value) if isinstance(value, list) else [str(value)])]


@pytest.mark.parametrize("key", FLAGGED, ids=lambda k: k.flag.name)
def test_each_flag_is_the_set_of_its_key_and_reaches_the_planner(key):
    """flag → request → recipe (the same as `--set` gives) → the planner's setup → plan → recipe."""
    value = key.flag.switch if key.flag.switch is not None else other_value(key)
    by_flag = request_of(_train(*_flag_argv(key, value)))
    assert by_flag.origins == {key.path: key.flag.name}
    recipe = resolve(None, by_flag.overrides, by_flag.origins)
    assert key.of(recipe) == value
    shown = value if not isinstance(value, list) else "[" + ", ".join(value) + "]"
    by_set = request_of(_train("--set", f"{key.path}={shown}"))
    assert resolve(None, by_set.overrides) == recipe and by_set.origins == {}
    if key.planned is not None:
        plan = check(ARCH, request_for(recipe, Target(80.0, 1.0)))
        assert key.of(apply_plan(Recipe(), plan)) == value


def test_train_offers_every_declared_flag_with_its_key_in_the_help():
    train = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    helps = {option: action.help for action in train._actions for option in action.option_strings}
    for name, key in FLAG_KEYS.items():
        assert key.flag_help and key.flag_help in helps[name] and key.path in helps[name], name


def test_a_flag_without_words_of_its_own_says_its_keys_help():
    """`--data` is `data.path`'s help as a line, not a second copy of it kept by hand."""
    data = FLAG_KEYS["--data"]
    assert data.path == "data.path" and not data.flag.help
    assert data.flag_help == "t" + data.help[1:-1]  # "Training data: … (org/name)." as a line
    assert all(k.flag_help == k.flag.help for k in FLAG_KEYS.values() if k.flag.help)


NUMERIC = [key for key in FLAGGED if key.type in (int, float)]


@pytest.mark.parametrize("key", NUMERIC, ids=lambda k: k.flag.name)
def test_a_bad_value_names_the_flag_or_set_or_the_file(key, tmp_path):
    """The origin of a wrong value is what the user typed: the flag, `--set`, or the recipe file."""
    by_flag = request_of(_train(key.flag.name, "many"))
    with pytest.raises(ConfigError, match=f"^{key.flag.name}: '{key.path}' must be"):
        resolve(None, by_flag.overrides, by_flag.origins)
    with pytest.raises(ConfigError, match=f"^--set: '{key.path}' must be"):
        resolve(None, request_of(_train("--set", f"{key.path}=many")).overrides)
    path = tmp_path / "mine.yaml"
    path.write_text(f"{key.section}:\n  {key.name}: many\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"^{path.resolve()}: '{key.path}' must be"):
        resolve(path)


def test_where_a_value_was_asked_is_said_one_way():
    flagged = request_of(_train("--seq-len", "4096"))
    for overrides, origins, said in (
        (flagged.overrides, flagged.origins, "--seq-len 4096"),
        ({"memory": {"max_seq_len": 4096}}, {}, "--set memory.max_seq_len=4096"),
        ({}, {}, "recipe 8gb"),
    ):
        origin = origin_of("memory.max_seq_len", overrides, origins)
        assert asked("memory.max_seq_len", 4096, origin, "8gb") == said
