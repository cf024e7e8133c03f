"""The package's import graph: no cycles, and the layers import only downstream (module- and function-level imports).

Data flows one way (CLI → recipe → choosing → memory model; train → run directory → report), so an import that
points back up is a design error even when Python tolerates it inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowmem_ft"
# Import edges allowed despite the rules below (none today: add one only with the reason beside it).
ALLOWED: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """Every module `name` imports, wherever the import statement is (top level or inside a function)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return found


EXTERNAL = {name: imports_of(name) for name in MODULES}  # each module parsed once, at collection
GRAPH = {name: {m for m in found if m in MODULES and m != name} for name, found in EXTERNAL.items()}


def test_the_graph_sees_function_level_imports():
    assert "lowmem_ft.preparing" in GRAPH["lowmem_ft.commands.plan"]  # imported inside run()
    assert "lowmem_ft.memory.arch" in GRAPH["lowmem_ft.choosing"]  # imported inside choose_recipe()


SUBPACKAGES = {f"lowmem_ft.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}


def unit(name: str) -> str:
    """The subpackage a module belongs to (`lowmem_ft.memory.planner` → `lowmem_ft.memory`), or the module itself."""
    package = ".".join(name.split(".")[:2])
    return package if package in SUBPACKAGES else name


PACKAGES: dict[str, set[str]] = {unit(v): set() for v in MODULES}
for _v, _targets in GRAPH.items():
    PACKAGES[unit(_v)].update(unit(w) for w in _targets if unit(w) != unit(_v) and (_v, w) not in ALLOWED)


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: a component of more than one node is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if (v, w) in ALLOWED:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_between_modules():
    assert cycles_of(GRAPH) == []


def test_no_import_cycles_between_packages():
    """memory ↔ recipe was one: the planner imported the recipe loader, the recipe chooser imported the planner."""
    assert "lowmem_ft.memory" in PACKAGES and "lowmem_ft.choosing" in PACKAGES
    assert cycles_of(PACKAGES) == []


def _violations(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{name} imports {target}"
        for name in MODULES
        if name == layer or name.startswith(layer + ".")
        for target in sorted(EXTERNAL[name])
        if any(target == f or target.startswith(f + ".") for f in forbidden) and (name, target) not in ALLOWED
    ]


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        # the memory model is pure arithmetic: plan is instant and knows no recipe
        ("lowmem_ft.memory", ("lowmem_ft.recipe", "lowmem_ft.choosing", "lowmem_ft.train", "torch", "transformers")),
        # the recipe is what the user wrote: it knows neither the memory model nor the trainer
        ("lowmem_ft.recipe", ("lowmem_ft.memory", "lowmem_ft.choosing", "lowmem_ft.train", "lowmem_ft.rundir")),
        # how a method is planned is arithmetic over the recipe: before choosing, and no trainer
        ("lowmem_ft.method_planning", ("lowmem_ft.choosing", "lowmem_ft.train", "lowmem_ft.commands", "torch")),
        # choosing a recipe happens before training and writes no run directory
        ("lowmem_ft.choosing", ("lowmem_ft.train", "lowmem_ft.rundir", "lowmem_ft.commands", "torch")),
        # the run directory is read by report, generate and merge: no trainer, no torch at import
        ("lowmem_ft.rundir", ("lowmem_ft.train", "lowmem_ft.commands")),
        # library modules do not reach up into the command line
        ("lowmem_ft.train", ("lowmem_ft.commands", "lowmem_ft.cli")),
        ("lowmem_ft.preparing", ("lowmem_ft.commands", "lowmem_ft.cli")),
        ("lowmem_ft.data", ("lowmem_ft.train", "lowmem_ft.commands", "lowmem_ft.choosing")),
        # development tooling never ships in (or is imported by) the package
        ("lowmem_ft", ("devkit", "tests")),
    ],
)
def test_layers_import_only_downstream(layer, forbidden):
    assert _violations(layer, forbidden) == []


# -- the rooms of `train` -------------------------------------------------------------------------------------------
TRAIN_ROOMS = {
    # measuring is a yardstick for every room: it knows the memory model, not the trainer it measures
    "lowmem_ft.train.measure": ("lowmem_ft.train",),
    # a method knows the trainer's parts, never the run that builds it nor the commands
    "lowmem_ft.train.methods": ("lowmem_ft.train.run", "lowmem_ft.train.ending", "lowmem_ft.train.distributed"),
    # observers observe: no policy (resilience) and no method imported
    "lowmem_ft.train.observe": ("lowmem_ft.train.resilience", "lowmem_ft.train.methods", "lowmem_ft.train.run"),
}


@pytest.mark.parametrize(("room", "forbidden"), sorted(TRAIN_ROOMS.items()))
def test_train_rooms_import_only_what_they_may(room, forbidden):
    found = [
        f"{name} imports {target}"
        for name in MODULES
        if name == room or name.startswith(room + ".")
        for target in sorted(GRAPH[name])
        if any(target == f or target.startswith(f + ".") for f in forbidden)
        and not (target == room or target.startswith(room + "."))
    ]
    assert found == []


def room(name: str) -> str:
    """A module's room: a sub-package of `train` (`lowmem_ft.train.trace`), else its package (`unit`)."""
    parts = name.split(".")
    if parts[:2] == ["lowmem_ft", "train"] and len(parts) > 3:
        return ".".join(parts[:3])
    return unit(name)


def private_imports(source: str, name: str) -> list[str]:
    """`from lowmem_ft.x import _name` in `source` (module `name`) where x lies in another room: one room reaching
    into another's private names (dunders aside)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowmem_ft") and not node.level:
            found += [
                f"{name} imports {node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__") and room(node.module) != room(name)
            ]
    return found


def test_no_module_imports_another_rooms_private_names():
    """Within one package (memory/, data/) a `_name` is shared by its modules; across rooms it is not."""
    found = [f for name, path in MODULES.items() for f in private_imports(path.read_text(encoding="utf-8"), name)]
    assert found == []


def test_the_private_import_check_sees_one():
    """What trace/step.py did with run.py's `_forget_bnb_overrides` is found; a package's own `_name` is not."""
    line = "from lowmem_ft.train.run import _forget_bnb_overrides\n"
    assert private_imports(line, "lowmem_ft.train.trace.step") == [
        "lowmem_ft.train.trace.step imports lowmem_ft.train.run._forget_bnb_overrides"
    ]
    assert private_imports("from lowmem_ft.memory.static import _x\n", "lowmem_ft.memory.estimate") == []


def test_the_train_map_names_every_room_and_module():
    """`lowmem_ft/train/__init__.py` is the package's map: each sub-package and each module is named in it."""
    import lowmem_ft.train as train

    where = PACKAGE / "train"
    rooms = {p.name for p in where.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in where.rglob("*.py") if p.stem != "__init__"}
    assert rooms and modules
    assert [r for r in sorted(rooms) if f"`{r}/`" not in train.__doc__] == []
    assert [m for m in sorted(modules) if f"`{m}`" not in train.__doc__ and f"{m}." not in train.__doc__] == []
