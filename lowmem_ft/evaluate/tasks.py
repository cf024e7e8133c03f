"""Task names and local task files, resolved through lm-eval's `TaskManager` before any model is loaded.

A `.yaml` argument is a task file of the user's own (lm-eval's format: `dataset_path: json` with `data_files` reads a
local JSON/JSONL file offline); its directory is given to `TaskManager(include_path=...)` and the task's name read
from its `task:` key. Names are looked up among lm-eval's own tasks (indexing them takes lm-eval ~45 s) and any
`--include-path` directory; an unknown one is one line with the closest names (difflib).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from lowmem_ft.errors import UserError


def resolve(spec: str, include_path: str | None = None, include_defaults: bool = True):
    """(TaskManager, task names) for `--tasks` (comma-separated names and/or .yaml files)."""
    import yaml
    from lm_eval.tasks import TaskManager

    names, paths = [], [include_path] if include_path else []
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
    return manager, names
