"""Task names and local task files, resolved through lm-eval's `TaskManager` before any model is loaded.

A `.yaml` argument is a task file of the user's own (lm-eval's format: `dataset_path: json` with `data_files` reads a
local JSON/JSONL file offline); its directory is given to `TaskManager(include_path=...)` and the task's name read
from its `task:` key. Names are looked up among lm-eval's own tasks (indexing them takes lm-eval ~45 s) and any
`--include-path` directory; an unknown one is one line with the closest names (difflib).

A task file's relative `data_files` (and `data_dir`) mean the file's own directory, as a task directory is written
to be moved around — but lm-eval hands them to `datasets.load_dataset`, which reads them against the working
directory. So a task file is loaded here with lm-eval's own YAML loader (its `include:` and `!function` resolved
against the file's directory, as lm-eval does), those paths made absolute, and the config given to lm-eval as an
inline task (`simple_evaluate` takes a dict spec) instead of the task's name.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from lowmem_ft.errors import UserError


def resolve(spec: str, include_path: str | None = None, include_defaults: bool = True):
    """(TaskManager, task specs) for `--tasks` (comma-separated names and/or .yaml files): a spec is a task name, or
    a task file's config with its paths resolved (module docstring); `task_name` names either."""
    import yaml
    from lm_eval.tasks import TaskManager

    names, paths, files = [], [include_path] if include_path else [], {}
    only_files = True
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item.endswith((".yaml", ".yml")):
            path = Path(item)
            if not path.is_file():
                raise UserError(f"--tasks {item}: no such task file")
            task = (yaml.safe_load(path.read_text()) or {}).get("task")
            if not task:
                raise UserError(f"--tasks {item}: the file has no `task:` name (lm-eval's task YAML format)")
            names.append(str(task))
            paths.append(str(path.parent.resolve()))
            files[str(task)] = path
        else:
            names.append(item)
            only_files = False
    if not names:
        raise UserError("--tasks: give task names or task .yaml files, comma-separated")
    manager = TaskManager(include_path=paths or None, include_defaults=include_defaults and not only_files)
    known = manager.all_tasks
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise UserError(f"--tasks: unknown task {name!r}{hint} (`lm-eval ls tasks` lists them)")
    return manager, [task_config(files[name]) if name in files else name for name in names]


def task_name(spec: str | dict) -> str:
    return spec if isinstance(spec, str) else str(spec["task"])


def task_config(path: Path) -> dict:
    """The task file's config as lm-eval loads it, its relative data paths made relative to the file."""
    from lm_eval.tasks._yaml_loader import load_yaml  # TaskManager's own loader (pinned lm-eval 0.4.13)

    config = load_yaml(path, resolve_func=True, recursive=True)
    kwargs = config.get("dataset_kwargs")
    if isinstance(kwargs, dict):
        here = path.resolve().parent
        config["dataset_kwargs"] = {
            **kwargs,
            **{key: _against(kwargs[key], here) for key in ("data_files", "data_dir") if key in kwargs},
        }
    return config


def _against(value, here: Path):
    """`value` (a path, a list of them, or split → paths) with each relative local path joined to `here`."""
    if isinstance(value, dict):
        return {split: _against(v, here) for split, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_against(v, here) for v in value]
    if isinstance(value, str) and "://" not in value and not Path(value).expanduser().is_absolute():
        return str(here / value)
    return value
