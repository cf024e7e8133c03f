"""GRPO's reward functions: the built-in ones named by string, the user's own from a file named on the command line.

The one idea: every reward is a callable in the form TRL 1.16's `GRPOTrainer._calculate_rewards` calls it —
`f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=..., log_extra=..., log_metric=...)`,
one number (or None: "does not apply", which TRL turns into NaN) per completion — wrapped in a `CheckedReward` that
turns a function that raises, returns the wrong length or a non-number into one line naming it (exit 2).
Every data column except `prompt`, `completion` and `completion_ids` reaches the functions by its name, a list with
one value per completion (TRL repeats a prompt's row for each of its `num_generations` completions).

Built-ins (`BUILTINS`), named in the recipe or on the command line as `NAME[:WEIGHT]`:
- `exact_match`: the completion's final answer equals the answer column's (whitespace and case folded).
- `numeric_match`: both final answers read as numbers and equal (GSM8K's `#### 1,234` form, `\\boxed{}`, or the
  last number of the text).
- `format`: the completion matches a regular expression (by default GSM8K's `#### <answer>` line).
- `length_penalty`: DAPO's soft overlong punishment (TRL's `get_soft_overlong_punishment`): 0 up to
  `max_completion_length - cache` tokens, falling linearly to -1 at `max_completion_length`.

A user's function comes from a Python file named **on the command line only** (`--reward-fn path.py:name[:weight]`):
running a file's code is the user's decision at the moment of the run, never a recipe's (a recipe can be shared,
downloaded or copied into a run directory), so recipe entries that name a file are refused, and `plan` never loads
one. Nothing here imports torch: the names are checked when a recipe is read.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError

# the entries' parsing lives with the recipe (which names rewards without importing them); re-exported here
from lowmem_ft.recipe.rewards import RewardSpec as RewardSpec
from lowmem_ft.recipe.rewards import parse_builtin as parse_builtin
from lowmem_ft.recipe.rewards import parse_reward_fn as parse_reward_fn

# What TRL passes besides the data columns (grpo_trainer.py `_calculate_rewards`): never a data column.
TRL_ARGUMENTS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)
# GSM8K's answers end in "#### 42"; a model trained on them writes the same line.
GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")
DEFAULT_FORMAT = r"####\s*\S+"


@dataclass(frozen=True)
class RewardOptions:
    """The built-ins' settings (the recipe's `training.grpo` keys feed them)."""

    answer_column: str = "answer"  # the data column the match rewards compare with
    format_regex: str = DEFAULT_FORMAT  # `format`'s pattern, searched anywhere in the completion
    max_completion_length: int = 256  # `length_penalty`'s L_max: TRL's max_completion_length
    length_cache: int = 0  # `length_penalty`'s soft band L_cache; 0: a quarter of max_completion_length


def completion_text(completion: Any) -> str:
    """A completion as text: TRL passes a string for plain prompts, a list of messages for conversations."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


def final_answer(text: str) -> str | None:
    """The final answer a text gives: after its last `####`, else inside its last `\\boxed{}`, else its last number."""
    found = GSM8K_ANSWER.findall(text)
    if found:
        return found[-1].strip()
    boxed = BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers_ = NUMBER.findall(text)
    return numbers_[-1] if numbers_ else None


def as_number(answer: str | None) -> float | None:
    """An answer as a number ("1,234", "$5", "-3.50", "7." all read), or None when it holds none."""
    if answer is None:
        return None
    found = NUMBER.findall(answer)
    if not found:
        return None
    try:
        return float(found[0].replace(",", "").replace("$", ""))
    except ValueError:
        return None


def _normal(answer: str | None) -> str | None:
    return None if answer is None else " ".join(answer.split()).casefold().rstrip(".")


class _ColumnReward:
    """A reward that compares each completion's final answer with the same row's answer column."""

    def __init__(self, name: str, column: str):
        self.__name__ = name  # TRL logs each reward under its callable's `__name__` (trainer/utils.py)
        self.column = column
        self.needs = (column,)

    def __call__(self, completions: list, **columns: Any) -> list[float | None]:
        answers = columns[self.column]
        return [self.score(completion_text(c), str(a)) for c, a in zip(completions, answers, strict=True)]

    def score(self, text: str, answer: str) -> float | None:
        raise NotImplementedError


class ExactMatch(_ColumnReward):
    def score(self, text: str, answer: str) -> float | None:
        gold = _normal(final_answer(answer) or answer)
        if not gold:
            return None  # an empty answer cannot be matched: the row does not count
        return 1.0 if _normal(final_answer(text)) == gold else 0.0


class NumericMatch(_ColumnReward):
    def score(self, text: str, answer: str) -> float | None:
        gold = as_number(final_answer(answer))
        if gold is None:
            return None  # the answer holds no number: the row does not count (TRL: NaN, left out of the mean)
        got = as_number(final_answer(text))
        return 1.0 if got is not None and math.isclose(got, gold, rel_tol=1e-9, abs_tol=1e-9) else 0.0


class FormatReward:
    __name__ = "format"
    needs: tuple[str, ...] = ()

    def __init__(self, pattern: str):
        self.pattern = re.compile(pattern, re.DOTALL | re.MULTILINE)

    def __call__(self, completions: list, **_: Any) -> list[float]:
        return [1.0 if self.pattern.search(completion_text(c)) else 0.0 for c in completions]


def _length_penalty(options: RewardOptions) -> Callable:
    from trl.rewards import get_soft_overlong_punishment

    cache = options.length_cache or max(1, options.max_completion_length // 4)
    fn = get_soft_overlong_punishment(options.max_completion_length, min(cache, options.max_completion_length))
    fn.__name__ = "length_penalty"
    fn.needs = ()
    return fn


BUILTINS: dict[str, Callable[[RewardOptions], Callable]] = {
    "exact_match": lambda o: ExactMatch("exact_match", o.answer_column),
    "numeric_match": lambda o: NumericMatch("numeric_match", o.answer_column),
    "format": lambda o: FormatReward(o.format_regex),
    "length_penalty": _length_penalty,
}


def load_user_function(spec: RewardSpec) -> Callable:
    """The function `spec.name` of the file `spec.path`, imported as a module of its own (its errors one line)."""
    path = Path(spec.path or "")
    if not path.is_file():
        raise UserError(f"--reward-fn {spec.label}: no such file {str(path)!r}")
    module_name = f"lowmem_ft_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"--reward-fn {spec.label}: {str(path)!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # TRL's async rollouts pickle reward functions by module
    try:
        module_spec.loader.exec_module(module)
    except SystemExit as exc:  # sys.exit at import would end lowmem-ft with its code and nothing printed
        raise UserError(f"--reward-fn {spec.label}: importing {path.name} called sys.exit({exc.code!r})") from None
    except Exception as exc:  # the user's code: any failure is theirs to fix, said in one line
        raise UserError(f"--reward-fn {spec.label}: importing {path.name} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, spec.name, None)
    if fn is None:
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise UserError(f"--reward-fn {spec.label}: {path.name} has no {spec.name!r} (it defines: {', '.join(found)})")
    if not callable(fn):
        raise UserError(f"--reward-fn {spec.label}: {spec.name!r} in {path.name} is not a function")
    return fn


def reward_flags(specs: Sequence[RewardSpec]) -> str:
    """The `--reward-fn` flags that name `specs` again (weights included): a GRPO run's resume command needs them,
    since a reward from a file is never recorded in its recipe."""
    import shlex

    entries = [f"{s.path}:{s.name}" + (f":{s.weight:g}" if s.weight != 1.0 else "") for s in specs if s.path]
    return " ".join(f"--reward-fn {shlex.quote(e)}" for e in entries)


def columns_needed(fn: Callable) -> tuple[str, ...]:
    """The data columns a reward function asks for: a built-in's `needs`, or a user function's parameters without
    a default that TRL does not fill itself (a `**kwargs` takes whatever there is)."""
    needs = getattr(fn, "needs", None)
    if needs is not None:
        return tuple(needs)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in TRL_ARGUMENTS
    )


class RewardFailed(UserError):
    """A reward function raised or returned something TRL cannot use."""


@dataclass
class CheckedReward:
    """A reward function as TRL calls it, whose failures are one line naming it (`RewardFailed`, exit 2)."""

    fn: Callable
    label: str
    weight: float = 1.0
    needs: tuple[str, ...] = field(default=())

    def __post_init__(self):
        self.__name__ = getattr(self.fn, "__name__", self.label)  # TRL's metric key: rewards/<name>/mean

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        state = kwargs.get("trainer_state")  # TRL passes the trainer's state: the step in progress is global_step + 1
        at = f" at step {state.global_step + 1}" if getattr(state, "global_step", None) is not None else ""
        try:
            out = self.fn(prompts=prompts, completions=completions, **kwargs)
        except UserError:
            raise
        except SystemExit as exc:  # sys.exit in a reward would end lowmem-ft with its code and no word
            raise RewardFailed(
                f"reward {self.label} called sys.exit({exc.code!r}){at}; a reward returns numbers"
            ) from None
        except Exception as exc:  # the reward's own bug: name it, keep the message, no traceback
            raise RewardFailed(f"reward {self.label} raised {type(exc).__name__}{at}: {exc}") from exc
        return self.check(out, len(completions), at, prompts)

    def check(self, out: Any, expected: int, at: str = "", prompts: Sequence | None = None) -> list[float | None]:
        """The reward's values, or one line naming it, the step (`at`) and the row: a non-list, the wrong length, a
        value that is not a number, or one that is not finite (NaN, inf: TRL would train on it — a NaN as if the
        reward did not apply, an inf turning the group's advantages into NaN). None is "does not apply" (TRL's
        documented form); a row no reward scores is the trainer's check (`grpo.unscored_problem`)."""
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) and not hasattr(out, "tolist"):
            raise RewardFailed(
                f"reward {self.label} returned a {type(out).__name__}{at}, not a list of {expected} numbers "
                "(one per completion)"
            )
        values = out.tolist() if hasattr(out, "tolist") else list(out)
        if len(values) != expected:
            raise RewardFailed(
                f"reward {self.label} returned {len(values)} values for {expected} completions{at} (one per completion)"
            )
        for i, v in enumerate(values):
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
                raise RewardFailed(
                    f"reward {self.label} returned {v!r} ({type(v).__name__}) for completion {i}{at}"
                    f"{row_of(prompts, i)}: each reward is a number, or None where it does not apply"
                )
            if v is not None and not math.isfinite(v):
                raise RewardFailed(
                    f"reward {self.label} returned {v!r} for completion {i}{at}{row_of(prompts, i)}: a reward must be "
                    "a finite number (None where it does not apply)"
                )
        return [None if v is None else float(v) for v in values]


def row_of(prompts: Sequence | None, i: int) -> str:
    """The row a completion answers, as a short quote of its prompt (the last message's text for a conversation)."""
    if not prompts or i >= len(prompts):
        return ""
    text = " ".join(completion_text(prompts[i][-1:] if isinstance(prompts[i], list) else prompts[i]).split())
    return f" (prompt {text[:60] + '…' if len(text) > 60 else text!r})"


def build_rewards(
    builtins: Sequence[RewardSpec],
    user: Sequence[RewardSpec],
    options: RewardOptions,
    columns: Sequence[str] | None = None,
) -> list[CheckedReward]:
    """The run's reward functions in order (built-ins, then the command line's files), checked; with `columns`
    (the data's), each function's needed columns are checked before any generation runs."""
    from lowmem_ft.recipe.rewards import rewards_problem

    problem = rewards_problem("grpo", [s.label for s in builtins], [s.label for s in user])
    if problem:
        raise UserError(problem)
    out = [CheckedReward(BUILTINS[s.name](options), s.label, s.weight) for s in builtins]
    out += [CheckedReward(load_user_function(s), s.label, s.weight) for s in user]
    for reward in out:
        reward.needs = columns_needed(reward.fn)
        missing = [c for c in reward.needs if columns is not None and c not in columns]
        if missing:
            have = [c for c in columns or () if c != "prompt"]
            # data.columns maps only the formats' own fields (`data.sources.FIELDS`): the fix names the reward's side
            fix = (
                f"point it at the column that holds the answers with --set grpo.answer_column={have[0] if have else 'COLUMN'}"
                if isinstance(reward.fn, _ColumnReward)
                else f"name that parameter of {reward.label} after one of the data's columns, or give it a default"
            )
            raise UserError(
                f"reward {reward.label} needs the data column {missing[0]!r}, which the data lacks (its columns "
                f"besides prompt: {', '.join(have) or 'none'}); {fix}"
            )
    names = [r.__name__ for r in out]
    for r in out:  # TRL logs rewards/<name>/mean: two of one name would share a line
        if names.count(r.__name__) > 1:
            r.__name__ = r.label
    return out
