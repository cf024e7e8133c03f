"""Recipes: the typed schema, YAML loading with inheritance and overrides, and the choice of a recipe for a VRAM target."""

from lowmem_ft.recipe.load import dump, resolve, shipped_recipes, to_dict
from lowmem_ft.recipe.schema import Recipe

__all__ = ["Recipe", "dump", "resolve", "shipped_recipes", "to_dict"]
