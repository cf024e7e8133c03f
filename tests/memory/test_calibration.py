"""The calibration table: every constant of the memory model in one module, each with where it comes from, and the
memory model pure arithmetic (no torch)."""

from __future__ import annotations

import ast
from pathlib import Path

from lowmem_ft.memory import calibration
from lowmem_ft.versions import CHECKED

MEMORY = Path(calibration.__file__).parent
# the modules the estimator's terms live in: their numbers come from the calibration table, not from constants
TERMS = ("records", "linears", "static", "activations", "transients", "recompute", "loss", "experts", "evaluation", "overheads",
         "estimate", "families", "blocks")  # fmt: skip


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    out = {}
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            for name in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(name, ast.Name) and name.id.isupper() and not name.id.startswith("_"):
                    out[name.id] = node.value
    return out


def _declared_with_source(tree: ast.Module) -> set[str]:
    """The constants whose declaration carries their `Source`: `NAME: Annotated[type, Source(...)] = value`."""
    return {
        node.target.id
        for node in tree.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.annotation, ast.Subscript)
        and ast.unparse(node.annotation).startswith("Annotated[")
        and "Source(" in ast.unparse(node.annotation)
    }


def test_every_constant_says_where_it_comes_from():
    defined = set(_constants(ast.parse(Path(calibration.__file__).read_text(encoding="utf-8"))))
    defined -= {"VERSIONS", "SOURCES"}
    assert defined == set(calibration.SOURCES)
    # each one declared once, its source beside its value (not in a table joined to it by name)
    assert _declared_with_source(ast.parse(Path(calibration.__file__).read_text(encoding="utf-8"))) == defined
    assert calibration.VERSIONS is CHECKED
    for name, source in calibration.SOURCES.items():
        assert source.kind in ("code", "measured", "code+measured", "assumed"), name
        assert source.where, name


def test_the_terms_modules_hold_no_numeric_constants_of_their_own():
    """A number the estimator uses is in the calibration table (units and dtype sizes aside)."""
    for module in TERMS:
        tree = ast.parse((MEMORY / f"{module}.py").read_text(encoding="utf-8"))
        numeric = {
            name
            for name, value in _constants(tree).items()
            if isinstance(value, (ast.Constant, ast.BinOp)) and not isinstance(getattr(value, "value", 0), str)
        }
        assert numeric <= {"GB"}, (module, numeric)


def test_the_memory_model_imports_no_torch():
    for path in MEMORY.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path.name
