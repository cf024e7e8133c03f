"""Choosing a recipe for a VRAM target: the one seam where the planner (`lowmem_ft.memory.planner`) plugs in.

`plan_recipe` is that seam: with --vram and no --recipe it plans from the tier recipe for the model; with both it
checks the given recipe against the target. `choose_recipe` wraps it for `train` and records the plan.
"""

from __future__ import annotations

import logging
import re

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.load import resolve, shipped_recipes
from lowmem_ft.recipe.schema import Recipe

log = logging.getLogger(__name__)


def tier_recipes() -> dict[float, str]:
    """Shipped tier recipes by their size in GB (`8gb.yaml` → 8.0)."""
    tiers = {}
    for name in shipped_recipes():
        match = re.fullmatch(r"(\d+(?:\.\d+)?)gb", name)
        if match:
            tiers[float(match.group(1))] = name
    return dict(sorted(tiers.items()))


def tier_for_vram(vram_gb: float, strict: bool = True) -> str:
    """The largest shipped tier not above `vram_gb` (the smallest tier when none is and not `strict`)."""
    tiers = tier_recipes()
    fitting = [size for size in tiers if size <= vram_gb]
    if not fitting and not strict:
        return tiers[min(tiers)]
    if not fitting:
        smallest = min(tiers)
        raise UserError(
            f"--vram {vram_gb:g}: no recipe tier fits under {vram_gb:g} GB (smallest is {smallest:g} GB); "
            "pass --recipe FILE with a smaller configuration"
        )
    return tiers[max(fitting)]


def start_recipe(vram_gb: float, recipe: str | None, overrides: dict) -> Recipe:
    """Where planning starts: `--recipe` if given, else the tier for `vram_gb`, with the overrides applied."""
    return resolve(recipe or tier_for_vram(vram_gb, strict=False), overrides)


def plan_recipe(
    *,
    vram_gb: float,
    recipe: str | None,
    overrides: dict,
    seq_len: int | None = None,
    profile=None,
    gpus: int = 1,
    strategy: str = "auto",
    offload: bool | None = None,
):
    """The plan for `vram_gb`: planned from the tier recipe, or (with `recipe`) that recipe checked as given."""
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.planner import check, plan

    start_name = recipe or tier_for_vram(vram_gb, strict=False)
    start = start_recipe(vram_gb, recipe, overrides)
    if not start.model.name_or_path:
        raise UserError("no model given; pass --model HUB_ID_OR_PATH")
    arch = load_architecture(start.model.name_or_path, start.model.trust_remote_code)
    if recipe is not None:
        if seq_len:
            start = resolve(
                start_name, {**overrides, "memory": {**overrides.get("memory", {}), "max_seq_len": seq_len}}
            )
        return check(start, arch, vram_gb, gpus, strategy, bool(offload))
    return plan(
        arch, vram_gb, start, gpus=gpus, seq_len=seq_len, profile=profile, fixed=overrides,
        strategy=strategy, offload=offload,
    )  # fmt: skip


def choose_recipe(
    *,
    vram_gb: float | None,
    recipe: str | None,
    overrides: dict,
    profile=None,
    gpus: int = 1,
    strategy: str = "auto",
    offload: bool | None = None,
) -> tuple[Recipe, dict]:
    """The recipe a run uses and a record of why: `--recipe` as given, else planned for `--vram`.

    `overrides` (from `--set` and flags such as `--model`) always win over the file and are never changed by the
    planner. With `--vram`, the record carries the plan (`predicted_peak_gb`, `budget_gb`, components, reasons);
    with `gpus` > 1 the figures are per device and `strategy` / `offload` say how the run is sharded.
    """
    if recipe is None and vram_gb is None:
        raise UserError("say how much GPU memory to fit: --vram GB (e.g. --vram 24), or give --recipe NAME_OR_FILE")
    if vram_gb is None:
        return resolve(recipe, overrides), {"how": "recipe", "recipe": recipe, "vram_gb": None}
    result = plan_recipe(
        vram_gb=vram_gb, recipe=recipe, overrides=overrides, profile=profile, gpus=gpus, strategy=strategy,
        offload=offload,
    )  # fmt: skip
    record = {k: v for k, v in result.to_dict().items() if k != "recipe"}
    if recipe is not None:
        if not result.fits:
            log.warning(
                "recipe %s is predicted to need %.1f GB, over the --vram %g budget of %.1f GB (margin %g GB); "
                "drop --recipe to let the planner choose, or see `lowmem-ft plan --vram %g --model %s`",
                recipe, result.estimate.peak_gb, vram_gb, result.budget_gb, result.margin_gb, vram_gb,
                result.recipe.model.name_or_path,
            )  # fmt: skip
        return result.recipe, {"how": "recipe", "recipe": recipe, **record}
    return result.recipe, {"how": "plan", "recipe": tier_for_vram(vram_gb, strict=False), **record}
