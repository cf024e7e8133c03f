"""Resolving a recipe: schema defaults < YAML (with `base:` inheritance) < `--set section.key=value`.

Every problem of a recipe is collected and reported at once as a `ConfigError`; an unknown key names the
nearest valid key, or the section it belongs under.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import os
import re
import types
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from lowmem_ft.console import first_time
from lowmem_ft.errors import ConfigError, UserError
from lowmem_ft.recipe.schema import (
    INT_LIMIT,
    KEYS,
    METHOD_INPUTS,
    SECTIONS,
    AdapterKind,
    Method,
    Recipe,
    in_range,
    span,
)

log = logging.getLogger(__name__)


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
    if path.is_dir():
        raise UserError(f"recipe {name_or_path}: a directory, not a recipe file (YAML)")
    shipped = shipped_recipes()
    if name_or_path in shipped:
        return shipped[name_or_path]
    hint = difflib.get_close_matches(name_or_path, list(shipped), n=1)
    suggestion = f"; did you mean '{hint[0]}'?" if hint else f"; shipped recipes: {', '.join(shipped)}"
    raise UserError(f"recipe '{name_or_path}' is neither a file nor a shipped recipe{suggestion}")


def _read_yaml(
    path: Path, seen: tuple[Path, ...] = (), run: tuple[str, str] | None = None, applied: dict | None = None
) -> dict[str, Any]:
    """Read a recipe file, merging the files it names in `base:` (a name or a path relative to it) beneath it.

    `run` = (training.method, adapter.kind) of the run: each file's own `methods:` defaults for them are laid over
    that file's keys (`method_defaults`, which records them in `applied`) before a file above it is merged; None:
    `methods:` blocks are checked and left out."""
    path = path.resolve()
    if path in seen:
        raise UserError(f"{path}: `base:` inheritance loops back to {path.name}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a text file (byte {exc.start} is not UTF-8); a recipe is YAML text") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the recipe ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise UserError(f"{path}: YAML nested deeper than the reader allows; a recipe is sections of keys") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    data = method_defaults(data, path, run, applied if applied is not None else {})
    if base is None:
        return data
    base_path = path.parent / base if (path.parent / base).is_file() else find_recipe(str(base))
    return merge(_read_yaml(base_path, (*seen, path), run, applied), data)


def method_blocks(data: dict[str, Any], path: Path) -> dict[str, dict[str, Any]]:
    """A recipe file's `methods:` mapping, checked: each name a training.method (`dpo`) or a method with an adapter
    kind (`dpo/full`), each block a mapping of sections that sets neither training.method nor adapter.kind."""
    blocks = data.get("methods") or {}
    methods, kinds = get_args(Method), get_args(AdapterKind)
    if not isinstance(blocks, dict):
        raise UserError(f"{path}: 'methods' maps a training.method to its defaults, got {type(blocks).__name__}")
    for name, block in blocks.items():
        method, _, kind = str(name).partition("/")
        if method not in methods or (kind and kind not in kinds):
            raise UserError(
                f"{path}: methods.{name}: expected a training.method ({', '.join(methods)}), optionally with an "
                f"adapter kind ({'/'.join(kinds)}), e.g. dpo/full"
            )
        if not isinstance(block, dict) or not all(isinstance(v, dict) for v in block.values()):
            raise UserError(f"{path}: methods.{name} must be a mapping of sections, like the recipe itself")
        if "method" in block.get("training", {}) or "kind" in block.get("adapter", {}):
            raise UserError(f"{path}: methods.{name} cannot set training.method or adapter.kind: it is chosen by them")
    return blocks


def method_defaults(
    data: dict[str, Any], path: Path, run: tuple[str, str] | None, applied: dict[str, tuple[Any, str]]
) -> dict[str, Any]:
    """A file's keys with its per-method defaults laid over them: `methods.<method>`, then `methods.<method>/<kind>`
    (e.g. DPO's learning rate, and a lower one for a full fine-tune). A file above this one, and the command line,
    still win: a user's explicit value always does (`resolve` says which defaults they replaced). `applied`:
    "section.key" → (value, where) of each default laid."""
    blocks = method_blocks(data, path)
    data = {k: v for k, v in data.items() if k != "methods"}
    if run is None:
        return data
    method, kind = run
    for name in (method, f"{method}/{kind}"):
        if name in blocks:
            data = merge(data, blocks[name])
            for section, values in blocks[name].items():
                for key, value in values.items():
                    applied[f"{section}.{key}"] = (value, f"{path.name} methods.{name}")
    return data


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
            problems.append(f"{item!r}: expected section.key=value, e.g. --set memory.micro_batch_size=4")
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
                of = ", ".join(map(str, get_args(inner))) if get_origin(inner) is Literal else inner.__name__
                return value, f"must be a list of {of}, got {value!r}"
        return value, None
    if origin is dict:  # e.g. data.columns: dict[str, str]; values are checked (and coerced) like fields
        key_tp, value_tp = get_args(tp)
        if not isinstance(value, dict):
            return value, f"must be a mapping ({{key: value, ...}}), got {value!r}"
        out = {}
        for k, v in value.items():
            v, problem = _type_problem(v, value_tp)
            if not isinstance(k, key_tp) or problem:
                return value, f"must map {key_tp.__name__} to {getattr(value_tp, '__name__', value_tp)}, got {value!r}"
            out[k] = v
        return out, None
    if tp is bool:
        return value, None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            return value, f"must be an integer, got {value!r}"
        return value, None if -INT_LIMIT < value < INT_LIMIT else f"must be below {INT_LIMIT:,} in size, got {value}"
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            return value, f"must be a number, got {value!r}"
        # .nan / .inf (YAML) and "nan" / "inf" (float()) pass every range comparison: refuse them here
        return number, None if math.isfinite(number) else f"must be a finite number, got {value!r}"
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value), None
        return value, None if isinstance(value, str) else f"must be a string, got {value!r}"
    return value, None


def _section_fields(section: str) -> dict[str, Any]:
    """Field name → type of one section (resolved annotations; a recipe is resolved a few times per command)."""
    hints = typing.get_type_hints(SECTIONS[section])
    return {f.name: hints[f.name] for f in fields(SECTIONS[section])}


def _unknown_key(section: str, key: str, known: dict[str, Any], all_keys: dict[str, str]) -> str:
    hint = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if hint:
        return f"unknown key '{section}.{key}'; did you mean '{section}.{hint[0]}'?"
    if key in all_keys:
        return f"unknown key '{section}.{key}': '{key}' belongs under '{all_keys[key]}.{key}'"
    return f"unknown key '{section}.{key}'; keys of '{section}' are {', '.join(known)}"


def check_keys(data: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
    """One layer of a recipe (a file or the overrides): its values coerced to the schema's types, and the problems
    of its keys and types as ("section.key", text) — an unknown key names the nearest valid one."""
    fields_of = {section: _section_fields(section) for section in SECTIONS}
    all_keys = {name: sec for sec, known in fields_of.items() for name in known}
    problems: list[tuple[str, str]] = []
    out: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        if section not in SECTIONS:
            hint = difflib.get_close_matches(section, list(SECTIONS), n=1)
            if section in all_keys:
                text = f"unknown section '{section}': '{section}' belongs under '{all_keys[section]}'"
            else:
                extra = f"; did you mean '{hint[0]}'?" if hint else f"; sections are {', '.join(SECTIONS)}"
                text = f"unknown section '{section}'{extra}"
            problems.append((section, text))
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            problems.append((section, f"section '{section}' must be a mapping of keys, got {values!r}"))
            continue
        known = fields_of[section]
        for key, value in values.items():
            if key not in known:
                problems.append((f"{section}.{key}", _unknown_key(section, key, known, all_keys)))
                continue
            value, problem = _type_problem(value, known[key])
            if problem:
                problems.append((f"{section}.{key}", f"'{section}.{key}' {problem}"))
                continue
            out.setdefault(section, {})[key] = value
    return out, problems


def _bounds(f) -> dict[str, Any]:
    """The range a field declares in its metadata (`ge`, `gt`, `lt`; see `schema._f`)."""
    return {k: f.metadata[k] for k in ("ge", "gt", "le", "lt") if f.metadata.get(k) is not None}


def _range_problem(f, value: Any) -> str | None:
    """The field's declared range, or None when the value is in it."""
    bounds = _bounds(f)
    if not bounds or in_range(value, **bounds):
        return None
    return f"must be {span(**bounds)}, got {value}"


def validate(recipe: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """Every rule of a built recipe as (the keys it concerns, problem): declared ranges, then cross-field checks."""
    problems: list[tuple[tuple[str, ...], str]] = []
    for section in SECTIONS:
        values = getattr(recipe, section)
        for f in fields(values):
            problem = _range_problem(f, getattr(values, f.name))
            if problem:
                problems.append(((f"{section}.{f.name}",), f"'{section}.{f.name}' {problem}"))
    m, a, d = recipe.memory, recipe.adapter, recipe.data
    if m.activation_offloading and not m.gradient_checkpointing:
        # transformers offloads the inputs of checkpointed layers (activation_checkpointing_enable(offload=True));
        # without checkpointing there is nothing it offloads.
        problems.append(
            (
                ("memory.activation_offloading", "memory.gradient_checkpointing"),
                "'memory.activation_offloading' offloads checkpointed layer inputs and needs "
                "memory.gradient_checkpointing=true; turn checkpointing on or offloading off",
            )
        )
    if m.chunked_loss and m.full_logits_loss:
        problems.append(
            (
                ("memory.chunked_loss", "memory.full_logits_loss"),
                "'memory.chunked_loss' and 'memory.full_logits_loss' are two ways to compute the loss; "
                "turn one of them off",
            )
        )
    if a.kind == "full" and recipe.model.quantization != "none":
        problems.append(
            (
                ("adapter.kind", "model.quantization"),
                f"'adapter.kind' full cannot train {recipe.model.quantization}-quantized weights; "
                "set model.quantization=none or adapter.kind=lora",
            )
        )
    if a.kind == "full" and a.name_or_path:
        problems.append(
            (
                ("adapter.kind", "adapter.name_or_path"),
                f"'adapter.name_or_path' ({a.name_or_path}) continues a LoRA adapter, but adapter.kind is full; "
                "drop one of them",
            )
        )
    problems += _init_problems(recipe)
    trackers = recipe.logging.report_to
    if "none" in trackers and len(trackers) > 1:
        problems.append(
            (
                ("logging.report_to",),
                f"'logging.report_to' {trackers}: 'none' cannot be combined with trackers; give none alone",
            )
        )
    if d.truncate == "chunk" and d.overlap >= m.max_seq_len:
        problems.append(
            (
                ("data.overlap", "data.truncate", "memory.max_seq_len"),
                f"'data.overlap' ({d.overlap}) must be smaller than memory.max_seq_len ({m.max_seq_len})",
            )
        )
    problems += _grpo_problems(recipe)
    if recipe.training.max_steps == 0 or recipe.training.max_steps < -1:
        problems.append(
            (
                ("training.max_steps",),
                f"'training.max_steps' must be -1 (use epochs) or positive, got {recipe.training.max_steps}",
            )
        )
    return problems


def _grpo_problems(recipe: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """The grpo section's rules: vLLM refused (why, in one line), each reward a built-in's NAME[:WEIGHT] — a recipe
    never names a Python file (`lowmem_ft.train.methods.rewards.parse_builtin`)."""
    from lowmem_ft.errors import UserError
    from lowmem_ft.recipe.rewards import parse_builtin

    g, problems = recipe.grpo, []
    if g.use_vllm:
        problems.append((("grpo.use_vllm",), VLLM_REFUSED))
    for entry in g.rewards:
        try:
            parse_builtin(entry, "'grpo.rewards'")
        except UserError as exc:
            problems.append((("grpo.rewards",), str(exc)))
    return problems


# TRL 1.16 `is_vllm_available` accepts vLLM 0.22-0.31 (trl/import_utils.py), each of which pins transformers below
# 5.18; the transformers this project pins (5.24) and those cannot be installed together.
VLLM_REFUSED = (
    "'grpo.use_vllm' is not supported: TRL 1.16 accepts vLLM 0.22-0.31, which require transformers < 5.18, and "
    "lowmem-ft pins transformers 5.24; drop it (generation runs on transformers)"
)


def build(layers: list[tuple[str, dict[str, Any]]], origins: dict[str, str] | None = None) -> Recipe:
    """Validate recipe layers, lowest first (`(origin, data)`: a file path, or "--set" for the overrides), and build
    the `Recipe`. Every problem is reported at once, each against where its value came from; `origins` names the
    flag behind an override key (`{"model.name_or_path": "--model"}`)."""
    origins = origins or {}
    problems: list[tuple[str, str]] = []
    merged: dict[str, Any] = {}
    where: dict[str, tuple[int, str]] = {}  # "section.key" → (layer, origin) of the value in effect

    def origin(layer_origin: str, key: str) -> str:
        return origins.get(key, layer_origin) if layer_origin == "--set" else layer_origin

    wrong: set[str] = set()
    for index, (layer_origin, data) in enumerate(layers):
        checked, layer_problems = check_keys(data)
        problems += [(origin(layer_origin, key), text) for key, text in layer_problems]
        wrong.update(key for key, _ in layer_problems)
        merged = merge(merged, checked)
        for section, values in checked.items():
            for key in values:
                where[f"{section}.{key}"] = (index, origin(layer_origin, f"{section}.{key}"))
    # the rules of the values that passed (a wrong key or type is reported once, above)
    recipe = Recipe(**{section: SECTIONS[section](**values) for section, values in merged.items()})
    for keys, text in validate(recipe):
        given = [where[k] for k in keys if k in where]
        if not wrong.intersection(keys):
            problems.append((max(given)[1] if given else "recipe", text))
    if problems:
        raise _config_error(problems)
    return recipe


def _config_error(problems: list[tuple[str, str]]) -> ConfigError:
    """One error for all problems: under their common origin, or each prefixed by its own."""
    sources = list(dict.fromkeys(source for source, _ in problems))
    if len(sources) == 1:
        return ConfigError([text for _, text in problems], source=sources[0])
    return ConfigError([f"{source}: {text}" for source, text in problems], source="recipe")


def _command_line_only(data: dict[str, Any], path: Path, granted: bool = False) -> dict[str, Any]:
    """A recipe file without `model.trust_remote_code: true`: running a model's own code is granted only on the
    command line of the command being run. A file may come from anyone — a run directory someone handed you is data —
    so it cannot grant itself code execution. `granted`: the command line grants it (then the file's true is moot,
    and nothing is said)."""
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("trust_remote_code"), bool):
        warn = model["trust_remote_code"] and not granted
        if warn and first_time("trust_remote_code", str(path)):  # train resolves it twice
            log.warning(
                "%s sets model.trust_remote_code: true, which only the command line can grant; it is off — pass "
                "--trust-remote-code if you trust the model's code",
                path,
            )
        data = {**data, "model": {k: v for k, v in model.items() if k != "trust_remote_code"}}
    return data


def resolve(
    recipe: str | Path | None = None,
    overrides: list[str] | dict | None = None,
    origins: dict[str, str] | None = None,
) -> Recipe:
    """Schema defaults < the recipe file (name or path, with `base:`) < overrides (`--set` strings or a dict).

    Problems of the file's keys name the file; problems of the overrides name `--set`, or the flag `origins` gives
    for the key (e.g. `{"memory.max_seq_len": "--seq-len"}`).
    """
    layers: list[tuple[str, dict[str, Any]]] = []
    given = (parse_overrides(overrides) if isinstance(overrides, list) else overrides) if overrides else {}
    applied: dict[str, tuple[Any, str]] = {}  # the per-method defaults laid, for what is said about them
    if recipe is not None:
        path = find_recipe(str(recipe))
        model = given.get("model")
        granted = isinstance(model, dict) and model.get("trust_remote_code") is True  # --trust-remote-code
        data = _read_yaml(path, run=_run_of(_read_yaml(path), given), applied=applied)
        layers.append((str(path), _command_line_only(data, path, granted)))
    if given:
        layers.append(("--set", given))
    built = build(layers, origins)
    _say_replaced_defaults(built, applied, given, origins or {})
    return built


def _run_of(data: dict[str, Any], given: dict[str, Any]) -> tuple[str, str]:
    """(training.method, adapter.kind) as the command line, else the recipe file, else the schema says."""

    def pick(section: str, key: str) -> str:
        for layer in (given, data):
            values = layer.get(section)
            if isinstance(values, dict) and key in values:
                return str(values[key])
        return str(KEYS[f"{section}.{key}"].default)

    return pick("training", "method"), pick("adapter", "kind")


def _say_replaced_defaults(
    recipe: Recipe, applied: dict[str, tuple[Any, str]], given: dict[str, Any], origins: dict[str, str]
) -> None:
    """Each per-method default a user's value replaced, said once (nothing replaced silently)."""
    for path, (default, where) in applied.items():
        value = KEYS[path].of(recipe) if path in KEYS else default
        if value == default:
            continue
        section, _, key = path.partition(".")
        by = origins.get(path, "--set") if key in (given.get(section) or {}) else "the recipe"
        if first_time("method default", path, str(value)):
            log.info("%s=%s from %s replaces the %s default %s", path, value, by, where, default)


def to_dict(recipe: Recipe) -> dict[str, Any]:
    return asdict(recipe)


def dump(recipe: Recipe, header: str | None = None) -> str:
    """The resolved recipe as YAML that `train --recipe` accepts."""
    text = yaml.safe_dump(to_dict(recipe), sort_keys=False, allow_unicode=True)
    return (f"# {header}\n" if header else "") + text


def field_help() -> dict[str, str]:
    """`section.key` → its documentation, from the schema (`recipes keys`): help, default, range and flag, and the
    tier recipes' per-method defaults."""
    per_method = tier_method_defaults()
    out = {}
    for path, key in KEYS.items():
        bounds = key.bounds
        where = f", {span(**bounds)}" if bounds else ""
        flag = ""
        if key.flag is not None:
            to = f" to {key.flag.switch}" if key.flag.switch not in (None, True) else ""
            flag = f"; {key.flag.name} sets it{to}"
        per = per_method.get(path)
        methods = "; per method in the tier recipes: " + ", ".join(f"{m} {v!r}" for m, v in per.items()) if per else ""
        out[path] = f"{key.help} (default: {key.default!r}{where}{flag}{methods})"
    return out


def tier_method_defaults() -> dict[str, dict[str, Any]]:
    """ "section.key" → {method (or method/adapter kind) → value} of the `methods:` block every tier inherits
    (the shipped base recipe's)."""
    path = shipped_recipes().get("base")
    if path is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    for name, block in method_blocks(raw, path).items():
        for section, values in block.items():
            for key, value in values.items():
                out.setdefault(f"{section}.{key}", {})[name] = value
    return out


# peft 0.21's init_lora_weights values lowmem-ft does not offer, and why (tuners/lora/config.py, layer.py)
_INIT_REFUSED = {
    "eva": "needs a pass over the training data to collect activations (peft's initialize_lora_eva_weights)",
    "corda": "needs a calibration pass over data first (peft's preprocess_corda)",
    "lora_ga": "needs gradients from a pass over data first (peft's preprocess_loraga)",
    "loftq": "quantizes the base weights itself (peft's loftq_config), which the plan does not describe",
    "mica": "freezes lora_B and trains lora_A only, which the plan does not describe",
    "orthogonal": "is not offered",
}


def _init_problems(recipe: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """adapter.init: one of the values lowmem-ft offers, on an adapter and a base it can work with."""
    a, key = recipe.adapter, ("adapter.init",)
    offered = "default, gaussian, pissa, pissa_niter_N (N ≥ 0), olora"
    if a.init in _INIT_REFUSED:
        return [(key, f"'adapter.init' {a.init} {_INIT_REFUSED[a.init]}; use one of {offered}")]
    if not re.fullmatch(r"default|gaussian|pissa|pissa_niter_\d+|olora", a.init):
        return [(key, f"'adapter.init' must be one of {offered}, got {a.init!r}")]
    if a.init == "default":
        return []
    if a.kind == "full":
        return [(("adapter.init", "adapter.kind"), f"'adapter.init' {a.init} starts a LoRA adapter, but "
                 "adapter.kind is full; set adapter.init=default")]  # fmt: skip
    if a.init == "gaussian":
        return []
    if recipe.model.quantization != "none":
        return [(("adapter.init", "model.quantization"),
                 f"'adapter.init' {a.init} rewrites the base weights with its residual, which "
                 f"{recipe.model.quantization} storage cannot hold exactly (peft refuses PiSSA on bitsandbytes "
                 "weights); set model.quantization=none, or adapter.init=default")]  # fmt: skip
    if a.use_dora:
        return [(("adapter.init", "adapter.use_dora"),
                 f"'adapter.init' {a.init} with DoRA: peft's conversion to a LoRA adapter on the original base "
                 "drops the magnitude vectors (subtract_mutated_init); turn one of them off")]  # fmt: skip
    if METHOD_INPUTS[recipe.training.method].reference:  # train.methods.preference drops TRL's copy of a new adapter
        return [(("adapter.init", "training.method"),
                 f"'adapter.init' {a.init} with {recipe.training.method}: the reference is the base with the adapter "
                 "disabled, which this init leaves as the residual, not the model; use adapter.init=default, or "
                 "orpo / simpo (no reference)")]  # fmt: skip
    if a.use_rslora:
        return [(("adapter.init", "adapter.use_rslora"),
                 f"'adapter.init' {a.init} with rsLoRA: the converted adapter's alpha becomes alpha·√2 (peft keeps "
                 "the scaling at rank 2r), not an integer lowmem-ft can continue; turn one of them off")]  # fmt: skip
    return []
