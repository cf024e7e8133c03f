"""Recipes: the typed schema and YAML loading with inheritance, overrides and validation (what the user wrote; choosing
one for a VRAM target is `lowmem_ft.choosing`)."""

from lowmem_ft.recipe.load import dump, resolve, shipped_recipes, to_dict
from lowmem_ft.recipe.schema import Recipe

__all__ = ["Recipe", "dump", "resolve", "shipped_recipes", "to_dict"]
