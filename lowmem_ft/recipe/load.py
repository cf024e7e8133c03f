"""Resolving a recipe: schema defaults < YAML (with `base:` inheritance) < `--set section.key=value`.

Every problem of a recipe is collected and reported at once as a `ConfigError`; an unknown key names the
nearest valid key, or the section it belongs under.
"""

from __future__ import annotations

import difflib
import functools
import os
import types
import typing
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from lowmem_ft.errors import ConfigError, UserError
from lowmem_ft.recipe.schema import SECTIONS, Recipe


def recipes_dir() -> Path:
    """Where the shipped recipes live: `$LOWMEM_FT_RECIPES`, else the package's `recipes/` (in a checkout, a link to
    the top-level `recipes/`; in an installed wheel, the files themselves)."""
    env = os.environ.get("LOWMEM_FT_RECIPES")
    if env:
        return Path(env)
    packaged = Path(__file__).resolve().parents[1] / "recipes"
    # a checkout without symlink support (Windows) has a one-line file there instead: use the top-level directory
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """Name → path of each YAML recipe shipped in `recipes/`."""
    return {p.stem: p for p in sorted(recipes_dir().glob("*.yaml"))}


def find_recipe(name_or_path: str) -> Path:
    """A recipe file by path, or by the name of a shipped recipe (`24gb`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_recipes()
    if name_or_path in shipped:
        return shipped[name_or_path]
    hint = difflib.get_close_matches(name_or_path, list(shipped), n=1)
    suggestion = f"; did you mean '{hint[0]}'?" if hint else f"; shipped recipes: {', '.join(shipped)}"
    raise UserError(f"recipe '{name_or_path}' is neither a file nor a shipped recipe{suggestion}")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a recipe file, merging the files it names in `base:` (a name or a path relative to it) beneath it."""
    path = path.resolve()
    if path in seen:
        raise UserError(f"{path}: `base:` inheritance loops back to {path.name}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    base_path = path.parent / base if (path.parent / base).is_file() else find_recipe(str(base))
    return merge(_read_yaml(base_path, (*seen, path)), data)


def merge(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge two recipe dicts; `high` wins, mappings merge key by key, lists replace."""
    out = dict(low)
    for key, value in high.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["memory.micro_batch_size=4", ...]` → nested dict; values are YAML scalars or lists."""
    out: dict[str, Any] = {}
    problems = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            problems.append(f"--set {item!r}: expected section.key=value, e.g. --set memory.micro_batch_size=4")
            continue
        section, _, name = key.strip().partition(".")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out.setdefault(section, {})[name] = value
    if problems:
        raise ConfigError(problems, source="--set")
    return out


def _type_problem(value: Any, tp: Any) -> tuple[Any, str | None]:
    """Check (and gently coerce) one value against a field type; return (value, problem or None)."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value, None
        return value, f"must be one of {', '.join(map(str, choices))}, got {value!r}"
    if origin in (typing.Union, types.UnionType):
        for arm in get_args(tp):
            if arm is type(None) and value is None:
                return value, None
        arms = [a for a in get_args(tp) if a is not type(None)]
        return _type_problem(value, arms[0])
    if origin is list:
        (inner,) = get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            return value, f"must be a list, got {value!r}"
        for v in value:
            if _type_problem(v, inner)[1]:
                return value, f"must be a list of {inner.__name__}, got {value!r}"
        return value, None
    if tp is bool:
        return value, None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return value, None if ok else f"must be an integer, got {value!r}"
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), None
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(value), None
            except ValueError:
                pass
        return value, f"must be a number, got {value!r}"
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value), None
        return value, None if isinstance(value, str) else f"must be a string, got {value!r}"
    return value, None


@functools.cache  # get_type_hints is slow, and the planner builds hundreds of recipes
def _section_fields(section: str) -> dict[str, Any]:
    hints = typing.get_type_hints(SECTIONS[section])
    return {f.name: hints[f.name] for f in fields(SECTIONS[section])}


def build(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Validate a merged recipe dict against the schema and build the `Recipe`; every problem is reported."""
    problems: list[str] = []
    all_keys = {name: sec for sec in SECTIONS for name in _section_fields(sec)}
    sections: dict[str, Any] = {}
    for section, values in data.items():
        if section not in SECTIONS:
            hint = difflib.get_close_matches(section, list(SECTIONS), n=1)
            if section in all_keys:
                problems.append(f"unknown section '{section}': '{section}' belongs under '{all_keys[section]}'")
            else:
                extra = f"; did you mean '{hint[0]}'?" if hint else f"; sections are {', '.join(SECTIONS)}"
                problems.append(f"unknown section '{section}'{extra}")
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            problems.append(f"section '{section}' must be a mapping of keys, got {values!r}")
            continue
        known = _section_fields(section)
        kwargs = {}
        for key, value in values.items():
            if key not in known:
                hint = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
                if hint:
                    problems.append(f"unknown key '{section}.{key}'; did you mean '{section}.{hint[0]}'?")
                elif key in all_keys:
                    problems.append(f"unknown key '{section}.{key}': '{key}' belongs under '{all_keys[key]}.{key}'")
                else:
                    problems.append(f"unknown key '{section}.{key}'; keys of '{section}' are {', '.join(known)}")
                continue
            value, problem = _type_problem(value, known[key])
            if problem:
                problems.append(f"'{section}.{key}' {problem}")
            kwargs[key] = value
        if not any(p.startswith(f"'{section}.") for p in problems):
            sections[section] = SECTIONS[section](**kwargs)
    recipe = Recipe(**sections)
    problems += validate(recipe)
    if problems:
        raise ConfigError(problems, source=source)
    return recipe


def validate(recipe: Recipe) -> list[str]:
    """Cross-field checks that a type alone cannot express."""
    problems = []
    m, a, d = recipe.memory, recipe.adapter, recipe.data
    for key in ("micro_batch_size", "gradient_accumulation", "max_seq_len"):
        if getattr(m, key) < 1:
            problems.append(f"'memory.{key}' must be at least 1, got {getattr(m, key)}")
    if m.eval_batch_size < 0:
        problems.append(f"'memory.eval_batch_size' must be ≥ 0 (0 = automatic), got {m.eval_batch_size}")
    if m.safety_margin_gb < 0:
        problems.append(f"'memory.safety_margin_gb' must be ≥ 0, got {m.safety_margin_gb}")
    if m.activation_offloading and not m.gradient_checkpointing:
        # transformers offloads the inputs of checkpointed layers (activation_checkpointing_enable(offload=True));
        # without checkpointing there is nothing it offloads.
        problems.append(
            "'memory.activation_offloading' offloads checkpointed layer inputs and needs "
            "memory.gradient_checkpointing=true; turn checkpointing on or offloading off"
        )
    if a.kind == "lora" and a.r < 1:
        problems.append(f"'adapter.r' must be at least 1, got {a.r}")
    if a.kind == "full" and recipe.model.quantization != "none":
        problems.append(
            f"'adapter.kind' full cannot train {recipe.model.quantization}-quantized weights; "
            "set model.quantization=none or adapter.kind=lora"
        )
    if d.truncate == "chunk" and d.overlap >= m.max_seq_len:
        problems.append(f"'data.overlap' ({d.overlap}) must be smaller than memory.max_seq_len ({m.max_seq_len})")
    if d.overlap < 0:
        problems.append(f"'data.overlap' must be ≥ 0, got {d.overlap}")
    if not 0.0 <= d.eval_fraction < 1.0:
        problems.append(f"'data.eval_fraction' must be in [0, 1), got {d.eval_fraction}")
    if not 0.0 <= recipe.optimizer.warmup_ratio < 1.0:
        problems.append(f"'optimizer.warmup_ratio' must be in [0, 1), got {recipe.optimizer.warmup_ratio}")
    if recipe.training.max_steps == 0 or recipe.training.max_steps < -1:
        problems.append(f"'training.max_steps' must be -1 (use epochs) or positive, got {recipe.training.max_steps}")
    return problems


def resolve(recipe: str | Path | None = None, overrides: list[str] | dict | None = None) -> Recipe:
    """Schema defaults < the recipe file (name or path, with `base:`) < overrides (`--set` strings or a dict)."""
    data: dict[str, Any] = {}
    source = "recipe"
    if recipe is not None:
        path = find_recipe(str(recipe))
        data = _read_yaml(path)
        source = str(path)
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = merge(data, extra)
    return build(data, source=source)


def to_dict(recipe: Recipe) -> dict[str, Any]:
    return asdict(recipe)


def dump(recipe: Recipe, header: str | None = None) -> str:
    """The resolved recipe as YAML that `train --recipe` accepts."""
    text = yaml.safe_dump(to_dict(recipe), sort_keys=False, allow_unicode=True)
    return (f"# {header}\n" if header else "") + text


def field_help() -> dict[str, str]:
    """`section.key` → its documentation, from the schema."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            out[f"{section}.{f.name}"] = f"{f.metadata.get('help', '')} (default: {default!r})"
    return out
