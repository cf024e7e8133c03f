"""The package stays readable in pieces: no module of `lowmem_ft` over MAX_MODULE_LINES lines, no function (or
method) over MAX_FUNCTION_LINES, docstring included — the sizes issue 20 set. Reads the source only (no import)."""

from __future__ import annotations

import ast
from pathlib import Path

import lowmem_ft

MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
PACKAGE = Path(lowmem_ft.__file__).parent


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_too_long():
    long = {
        str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_too_long():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_walk_sees_the_package():
    """The limits above cannot pass by reading nothing: the package's modules and their functions are there."""
    modules = _modules()
    assert len(modules) > 50 and PACKAGE / "memory" / "savers.py" in modules
    functions = [n for p in modules for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef)]
    assert len(functions) > 500
