"""One record per model family: the architecture reader and the estimator read `lowmem_ft.memory.families`, and no
other module of the memory model tells families apart by their model_type."""

from __future__ import annotations

import ast
from pathlib import Path

from lowmem_ft.memory import arch, families
from lowmem_ft.memory.activations import ROPE_CAT_FAMILIES
from lowmem_ft.memory.blocks import BUILDERS
from lowmem_ft.memory.families import FAMILIES, UNKNOWN, family

MEMORY = Path(families.__file__).parent


def _compares_model_type(node: ast.AST) -> bool:
    """`model_type == "x"`, `model_type in ("x", ...)`, `x.model_type.startswith("x")` and the like."""
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        names = [s.attr if isinstance(s, ast.Attribute) else getattr(s, "id", "") for s in sides]
        literal = any(isinstance(s, (ast.Constant, ast.Tuple, ast.Set, ast.List)) for s in sides[1:])
        return "model_type" in names and literal
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
        target = node.func.value
        return (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")) == "model_type"
    return False


def test_no_module_but_the_registry_tells_families_apart_by_name():
    for path in sorted(MEMORY.glob("*.py")):
        if path.name == "families.py":
            continue
        hits = [n.lineno for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if _compares_model_type(n)]
        assert not hits, f"{path.name} compares model_type with a name at lines {hits}: read its Family record"


def test_the_tables_the_package_reads_are_views_of_the_records():
    assert {t: f.no_sdpa for t, f in FAMILIES.items() if f.no_sdpa} == arch.NO_SDPA
    assert {"gemma2", "gpt_oss"} <= set(arch.NO_SDPA)
    assert {t for t, f in FAMILIES.items() if f.chunked_loss_verified} == arch.CHUNKED_LOSS_VERIFIED
    assert arch.MOE_FAMILIES == ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe")
    assert set(arch.NON_LLAMA_BLOCKS) == {"gpt_neox", "falcon", "phi", "starcoder2"}
    assert all(f.block in {"llama", "moe", *BUILDERS} for f in FAMILIES.values())
    assert {"phi3", "phi", "glm", "glm4", "nemotron", "gpt_neox"} == ROPE_CAT_FAMILIES
    assert arch.CLASS_DEFAULTS["qwen3"] == {"head_dim": 128}


def test_an_unknown_family_reads_as_llama_and_warns():
    assert family("brand_new") is UNKNOWN and UNKNOWN.block == "llama" and not UNKNOWN.checked
    new = arch.Architecture.from_config({"model_type": "brand_new", "vocab_size": 64, "hidden_size": 32,
                                         "intermediate_size": 64, "num_hidden_layers": 1,
                                         "num_attention_heads": 4})  # fmt: skip
    assert arch.unchecked_family(new) and not new.tie_embeddings
    assert family("gemma9").tied_default  # an unknown Gemma ties as every Gemma config class does
