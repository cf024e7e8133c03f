"""Choosing a recipe for a VRAM target: the one seam the planner (`lowmem_ft.memory.planner`) plugs into."""

from __future__ import annotations

import re

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.load import resolve, shipped_recipes
from lowmem_ft.recipe.schema import Recipe


def tier_recipes() -> dict[float, str]:
    """Shipped tier recipes by their size in GB (`8gb.yaml` → 8.0)."""
    tiers = {}
    for name in shipped_recipes():
        match = re.fullmatch(r"(\d+(?:\.\d+)?)gb", name)
        if match:
            tiers[float(match.group(1))] = name
    return dict(sorted(tiers.items()))


def tier_for_vram(vram_gb: float) -> str:
    """The largest shipped tier not above `vram_gb`."""
    tiers = tier_recipes()
    fitting = [size for size in tiers if size <= vram_gb]
    if not fitting:
        smallest = min(tiers)
        raise UserError(
            f"--vram {vram_gb:g}: no recipe tier fits under {vram_gb:g} GB (smallest is {smallest:g} GB); "
            "pass --recipe FILE with a smaller configuration"
        )
    return tiers[max(fitting)]


def choose_recipe(
    *,
    vram_gb: float | None,
    recipe: str | None,
    overrides: dict,
) -> tuple[Recipe, dict]:
    """The recipe a run uses and a record of why: `--recipe` as given, else the tier for `--vram`.

    `overrides` (from `--set` and flags such as `--model`) always win over the file.
    """
    if recipe is None and vram_gb is None:
        raise UserError("say how much GPU memory to fit: --vram GB (e.g. --vram 24), or give --recipe NAME_OR_FILE")
    if recipe is not None:
        return resolve(recipe, overrides), {"how": "recipe", "recipe": recipe, "vram_gb": vram_gb}
    tier = tier_for_vram(vram_gb)
    return resolve(tier, overrides), {"how": "tier", "recipe": tier, "vram_gb": vram_gb}
