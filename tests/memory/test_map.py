"""The memory model's map (`lowmem_ft.memory.LAYERS`, the package docstring): every module has one layer, and a
module imports only from its own layer or the ones above it (describe → constants → terms → compose → methods and
search)."""

from __future__ import annotations

import ast
from pathlib import Path

import lowmem_ft.memory as memory

MEMORY = Path(memory.__file__).parent
MODULES = sorted(p.stem for p in MEMORY.glob("*.py") if p.stem != "__init__")
LAYER_OF = {module: depth for depth, modules in enumerate(memory.LAYERS.values()) for module in modules}


def memory_imports(source: str) -> set[str]:
    """The modules of `lowmem_ft.memory` a source imports, at any level (a function's imports too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowmem_ft.memory."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.ImportFrom) and node.module == "lowmem_ft.memory":
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("lowmem_ft.memory."))
    return found


def upward(module: str, source: str) -> list[str]:
    return [f"{module} imports {m}" for m in sorted(memory_imports(source)) if LAYER_OF[m] > LAYER_OF[module]]


def test_every_module_has_one_layer_and_the_docstring_names_it():
    listed = [m for modules in memory.LAYERS.values() for m in modules]
    assert sorted(listed) == MODULES  # none missing, none twice, none that does not exist
    for module in MODULES:
        assert f"`{module}`" in memory.__doc__, module


def test_a_module_imports_only_its_own_layer_or_above():
    found = [line for m in MODULES for line in upward(m, (MEMORY / f"{m}.py").read_text(encoding="utf-8"))]
    assert found == []


def test_the_order_check_sees_an_upward_import():
    """A term reaching down to the planner is refused; the planner reading a term is not."""
    assert upward("static", "def f():\n    from lowmem_ft.memory.planner import plan\n") == ["static imports planner"]
    assert upward("planner", "from lowmem_ft.memory.static import weight_bytes\n") == []
