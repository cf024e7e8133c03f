"""devkit is one package run with `python -m devkit.…` from the repository root: no module edits `sys.path`, no import
cycle, `scripts/` keeps only the shell entry points, every command and file the docs name exists, and no file of the
repository carries a path of one particular machine."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVKIT = ROOT / "devkit"


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(DEVKIT.rglob("*.py"))}
# where commands and files of the dev tooling are named
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md")),
        *sorted((ROOT / "scripts").iterdir())]  # fmt: skip
MENTIONS = [*DOCS, *MODULES.values(), *sorted((ROOT / "tests").rglob("*.py"))]


def _imports(name: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{a.name}" for a in node.names)
            found.add(node.module)
    return {m for m in found if m in MODULES and m != name}


def test_no_module_edits_sys_path():
    files = [*MODULES.values(), *(ROOT / "scripts").iterdir(), *(ROOT / "tests").rglob("*.py")]
    edits = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in
             enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if re.search(r"sys\.path\.(insert|append)|sys\.path\s*=|sys\.path\s*\+=", line)]  # fmt: skip
    assert edits == []


def test_scripts_holds_only_shell_entry_points():
    """And setup.sh's pins (constraints.txt): dev tooling in Python lives in devkit."""
    entries = ["constraints.txt", "demo.sh", "gpu_check.sh", "setup.sh", "test.sh"]
    assert sorted(p.name for p in (ROOT / "scripts").iterdir()) == entries


def test_no_import_cycle():
    graph = {name: _imports(name) for name in MODULES}
    assert "devkit.harness.estimator" in graph["devkit.gpu.report"]  # the graph sees function-level imports
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, " -> ".join([*path, name])
        if name not in done:
            for target in sorted(graph[name]):
                visit(target, [*path, name])
            done.add(name)

    for name in graph:
        visit(name, [])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


def _commands() -> set[str]:
    return {
        m
        for p in MENTIONS
        for m in re.findall(r"python3? -m (devkit(?:\.[a-z_]+)+)\b(?![.…])", p.read_text(encoding="utf-8"))
    }


def test_every_command_named_is_a_runnable_module():
    commands = _commands()
    assert {"devkit.gpu.check", "devkit.gpu.kit", "devkit.tiny", "devkit.bench.estimator"} <= commands
    for command in sorted(commands):
        assert command in MODULES, f"`python -m {command}` is named but no such module"
        assert 'if __name__ == "__main__":' in MODULES[command].read_text(encoding="utf-8"), command


def test_every_file_named_exists():
    missing = sorted(
        {f"{p.relative_to(ROOT)}: {m}" for p in MENTIONS for m in re.findall(r"(?<![\w/])(devkit/[\w/]+\.py|scripts/\w+\.\w+)",
         p.read_text(encoding="utf-8")) if not (ROOT / m).exists()}
    )  # fmt: skip
    assert missing == []


def test_no_path_of_one_machine():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    pattern = re.compile(r"(?<![\w.])/(?:" + "|".join(["work", "home", "root", "Users", "mnt", "opt"]) + r")/[\w.]")
    found = [
        f"{name}:{i}"
        for name in (f.decode() for f in files if f)
        if (ROOT / name).is_file() and not name.endswith((".json", ".png"))
        for i, line in enumerate((ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("table", sorted(p.name for p in (ROOT / "benchmarks").glob("*.md")))
def test_every_benchmark_names_the_command_that_made_it(table):
    text = (ROOT / "benchmarks" / table).read_text(encoding="utf-8")
    assert re.search(r"`(python -m devkit\.[a-z_.]+|bash scripts/\w+\.sh)[^`]*`", text), table
