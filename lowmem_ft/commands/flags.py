"""Flags shared by the commands: argparse `type=` functions that check values where they enter, the flags
several commands take (`--set`, `--push-to-hub`), and the flags of recipe keys, made from their declaration.

The one idea: a bad flag value is refused while the command line is parsed — before any file is read or any model
loaded — in one line that names the flag, the rule and the value (`lowmem_ft.cli` prints argparse's errors as one
line). Range rules that need the recipe or the model (`--vram` above the safety margin, `--seq-len` within the model's
positions) are checked where those are known (`lowmem_ft.choosing`). A recipe key's flag (`schema.Flag`: `--seq-len`,
`--model`, …) is `--set` of its key: its value is checked with the recipe, in the message `--set` would give, naming
the flag (`key_overrides` says which flag set which key).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin

from lowmem_ft.recipe.schema import INT_LIMIT, KEYS, Key, in_range, span


def _parse(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if kind is int and not -INT_LIMIT < value < INT_LIMIT:
        raise argparse.ArgumentTypeError(f"must be below {INT_LIMIT:,} in size, got {text}")
    return value


def ranged(
    kind: type, *, ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
    unit: str = "",
) -> Callable[[str], float | int]:  # fmt: skip
    """An argparse type: a finite `kind` (int or float) within the given bounds."""

    def parse(text: str) -> float | int:
        value = _parse(text, kind)
        if not in_range(value, ge=ge, gt=gt, le=le, lt=lt):
            raise argparse.ArgumentTypeError(f"must be {span(ge=ge, gt=gt, le=le, lt=lt)}{unit}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


# The flags several commands share.
vram_gb = ranged(float, gt=0, unit=" GB")  # above the recipe's safety margin too: checked by lowmem_ft.choosing
count = ranged(int, ge=1)  # --gpus, --nodes, --max-new-tokens, --max-len
seed = ranged(int, ge=0)


def shard_size(text: str) -> str:
    """--max-shard-size as transformers' `convert_file_size_to_int` reads it (utils/hub.py): a positive integer and
    a unit — GB, MB, KB (decimal), GiB, MiB, KiB; a lower-case "b" means bits there, as in "5Gb"."""
    match = re.fullmatch(r"(\d+)\s*([GMK]I?B)", text.strip(), flags=re.IGNORECASE)
    if not match or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive whole number and a unit (e.g. 5GB, 500MB, 2GiB), got {text!r}"
        )
    return text.strip()


def run_name(text: str) -> str:
    """--name: a name, not a path (`lowmem_ft.rundir.check_run_name`), refused before any work."""
    from lowmem_ft.errors import UserError
    from lowmem_ft.rundir import check_run_name

    try:
        return check_run_name(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--name ")) from None


def add_set(parser, help: str) -> None:
    """`--set SECTION.KEY=VALUE`, repeatable, into `args.overrides` (parsed by `lowmem_ft.recipe.load`)."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help)


def add_push_to_hub(parser, what: str, when: str) -> None:
    """`--push-to-hub REPO` and `--hub-private` (`lowmem_ft.hub`): upload `what` with its model card `when`."""
    parser.add_argument(
        "--push-to-hub",
        metavar="REPO",
        help=f"upload {what} with a model card to this Hub repo (NAME or ORG/NAME) {when}; login and network are "
        "checked before any work starts",
    )
    parser.add_argument("--hub-private", action="store_true", help="create the --push-to-hub repo private")


# -- the flags of recipe keys (declared with the key: `lowmem_ft.recipe.schema.Flag`) ----------------------------
FLAG_KEYS: dict[str, Key] = {key.flag.name: key for key in KEYS.values() if key.flag is not None}
"""Flag → the recipe key it sets, for every key declared with one."""


def _dest(key: Key) -> str:
    return key.flag.name.removeprefix("--").replace("-", "_")


def _choices(tp: Any) -> list[str] | None:
    """The choices of a `Literal` key (or a list of one): what `--help` shows and argparse checks."""
    if get_origin(tp) is list:
        (tp,) = get_args(tp)
    return list(get_args(tp)) if get_origin(tp) is Literal else None


def add_key_flags(parser, *names: str, checked: bool = False, note: str = "", **kw) -> None:
    """Add the flags `names` (e.g. "--seq-len") of their recipe keys to `parser`: help, metavar, choices, a list's
    nargs and a switch's store_true from the declaration; `note` adds a command's own words to the help, `kw` goes
    to argparse (`required=True`). `checked`: a number is refused while parsing, against the key's declared type and
    range (what `plan` does, before any file is read); otherwise it is checked with the recipe, as `--set` is."""
    for name in names:
        key = FLAG_KEYS[name]
        flag = key.flag
        said = f"{key.path}={flag.switch}" if flag.switch not in (None, True) else key.path
        options: dict[str, Any] = {"dest": _dest(key), "help": f"{key.flag_help} ({said}){note}"}
        if flag.switch is not None:
            parser.add_argument(name, action="store_true", **options, **kw)
            continue
        options["metavar"] = flag.metavar
        choices = _choices(key.type)
        if choices is not None:
            options["choices"] = [c for c in choices if c not in flag.hidden_choices]
        if get_origin(key.type) is list:
            options["nargs"] = "+"
        if checked and key.type in (int, float):
            options["type"] = ranged(key.type, **key.bounds)
        parser.add_argument(name, **{**options, **kw})


def key_overrides(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """The recipe keys the flags on this command line set, as overrides (the flags a parser has that were given),
    and the flag behind each key (`origins`, for error messages). A value is read as `--set` reads it — a YAML
    scalar — except a string key's, taken as typed (a path may look like a number or `null`)."""
    from lowmem_ft.recipe.load import parse_overrides

    overrides: dict = {}
    origins: dict[str, str] = {}
    for name, key in FLAG_KEYS.items():
        value = getattr(args, _dest(key), None)
        if value is None or value is False:
            continue
        if key.flag.switch is not None:
            value = key.flag.switch
        elif isinstance(value, str) and key.type is not str:
            value = parse_overrides([f"{key.path}={value}"])[key.section][key.name]
        overrides.setdefault(key.section, {})[key.name] = value
        origins[key.path] = name
    return overrides, origins
