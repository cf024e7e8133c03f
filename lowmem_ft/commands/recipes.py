"""`lowmem-ft recipes`: list the shipped recipes, show one resolved, or document every key."""

from __future__ import annotations

import argparse

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.load import dump, field_help, find_recipe, resolve, shipped_recipes


def add_parser(sub) -> None:
    p = sub.add_parser(
        "recipes",
        help="list shipped recipes, show one resolved, or list every key",
        description="List the shipped recipes, show one fully resolved (its base and --set applied), or document "
        "every recipe key: its help, default, range and flag.",
    )
    p.add_argument(
        "action",
        nargs="?",
        choices=["list", "show", "keys"],
        default="list",
        help="list (default): the shipped recipes; show NAME: one resolved; keys: every key with its documentation",
    )
    p.add_argument("name", nargs="?", help="recipe name (e.g. 24gb) or YAML path, for `show`")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="for `show`: override one recipe key; repeatable (e.g. --set training.method=dpo)",
    )
    p.set_defaults(func=run)


def _summary(path) -> str:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    return first.lstrip("# ").strip()


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from lowmem_ft.console import rich_console

    if args.action == "list":
        table = Table(title="shipped recipes (lowmem-ft recipes show NAME)")
        table.add_column("name")
        table.add_column("what")
        for name, path in shipped_recipes().items():
            table.add_row(name, _summary(path))
        rich_console().print(table)
        return 0
    if args.action == "keys":
        for key, text in field_help().items():
            print(f"{key}: {text}")
        return 0
    if not args.name:
        raise UserError("give a recipe name, e.g. `lowmem-ft recipes show 24gb`")
    path = find_recipe(args.name)
    recipe = resolve(path, args.overrides)
    print(dump(recipe, header=f"{args.name} resolved ({path})"), end="")
    return 0
