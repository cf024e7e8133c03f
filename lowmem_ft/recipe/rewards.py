"""Reward entries as a recipe or the command line names them — parsed and checked without importing a reward.

The one idea: a recipe may name only built-in rewards (`grpo.rewards`: `NAME[:WEIGHT]`); a reward function from a
Python file is named on the command line only (`--reward-fn path.py:name[:weight]`), since a recipe can be shared,
downloaded or copied into a run directory and must never make a run execute code. The reward functions themselves
live in `lowmem_ft.train.methods.rewards`; this module knows their names, so a recipe is checked when it is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import METHOD_INPUTS

# The built-in rewards' names (`lowmem_ft.train.methods.rewards.BUILTINS` implements each)
BUILTIN_REWARDS = ("exact_match", "numeric_match", "format", "length_penalty")


@dataclass(frozen=True)
class RewardSpec:
    """One reward as the user named it: a built-in's name, or a file and a function in it; and its weight."""

    name: str
    weight: float = 1.0
    path: str | None = None  # a user's file (command line only)

    @property
    def label(self) -> str:
        return f"{self.path}:{self.name}" if self.path else self.name


def _weight(text: str, where: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise UserError(f"{where}: weight {text!r} is not a number") from None
    if not math.isfinite(weight):
        raise UserError(f"{where}: weight {text!r} is not a finite number")
    return weight


def parse_builtin(entry: str, where: str = "grpo.rewards") -> RewardSpec:
    """`NAME[:WEIGHT]` of a built-in (a recipe's entry or `--reward`); an entry naming a file is refused."""
    name, _, weight = entry.strip().partition(":")
    if name.endswith(".py") or "/" in name or "\\" in name or weight.partition(":")[0].endswith(".py"):
        raise UserError(
            f"{where}: {entry!r} names a Python file; a reward function from a file is named on the command line "
            "only (--reward-fn path.py:name), so that no recipe or run directory can make a run execute code"
        )
    if name not in BUILTIN_REWARDS:
        raise UserError(f"{where}: unknown reward {name!r}; the built-in rewards are {', '.join(BUILTIN_REWARDS)}")
    return RewardSpec(name, _weight(weight, where) if weight else 1.0)


def parse_reward_fn(entry: str) -> RewardSpec:
    """`path.py:name[:weight]` of `--reward-fn`."""
    where = f"--reward-fn {entry}"
    head, weight = entry, 1.0
    rest, _, last = entry.rpartition(":")
    if rest and ":" in rest and not last.endswith(".py"):
        try:
            weight, head = float(last), rest
        except ValueError:
            # `ok.py:const:abc`: a file, a function, then a weight that is not a number (not a file `ok.py:const`)
            if not last.isidentifier() or rest.rpartition(":")[0].endswith(".py"):
                raise UserError(f"{where}: weight {last!r} is not a number") from None
    path, _, name = head.rpartition(":")
    if not path or not name or not name.isidentifier():
        raise UserError(f"{where}: expected PATH.py:FUNCTION[:WEIGHT], e.g. rewards.py:correct:2.0")
    if not math.isfinite(weight):
        raise UserError(f"{where}: weight is not a finite number")
    return RewardSpec(name, weight, path)


def rewards_problem(method: str, builtins: list[str], reward_fns: tuple[str, ...] | list[str]) -> str | None:
    """Whether a run names the rewards its method needs, checked before any weight is read or rank launched: GRPO
    needs at least one (`grpo.rewards` or `--reward-fn`), and only GRPO takes `--reward-fn`."""
    scored = METHOD_INPUTS[method].rewards
    if scored and not builtins and not reward_fns:
        return (
            "--method grpo needs a reward: name a built-in with --set grpo.rewards=[NAME] "
            f"({', '.join(BUILTIN_REWARDS)}), or your own function with --reward-fn path.py:name"
        )
    if not scored and reward_fns:
        return f"--reward-fn is for --method grpo; this run's method is {method}"
    return None
