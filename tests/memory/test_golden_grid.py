"""The memory model gives exactly the numbers recorded in golden_grid.json.gz (see golden_grid.py): every component,
phase peak, per-token term, plan and generation budget, over every catalog model and a config of every family.
Recorded before the memory model was split into modules by concern; a change of any number fails here."""

from __future__ import annotations

from typing import Any

import golden_grid
import pytest

GOLDEN = golden_grid.load()


def _first_difference(got: Any, want: Any, path: str = "") -> str | None:
    if isinstance(want, dict) and isinstance(got, dict):
        if got.keys() != want.keys():
            return f"{path}: keys {sorted(set(got) ^ set(want))} differ"
        return next((d for k in want if (d := _first_difference(got[k], want[k], f"{path}/{k}"))), None)
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return f"{path}: {len(got)} entries, recorded {len(want)}"
        pairs = enumerate(zip(got, want, strict=True))
        return next((d for i, (g, w) in pairs if (d := _first_difference(g, w, f"{path}/{i}"))), None)
    return None if got == want and type(got) is type(want) else f"{path}: {got!r}, recorded {want!r}"


@pytest.mark.parametrize("name", sorted(GOLDEN["models"]))
def test_every_setup_of_every_model_gives_the_recorded_numbers(name):
    record = GOLDEN["models"][name]
    arch = golden_grid.architecture(record["spec"])
    got = golden_grid.normalized({
        "arch": golden_grid.arch_record(arch),
        "setups": [{"fields": p["fields"], **golden_grid.setup_record(arch, p["fields"])} for p in record["setups"]],
        "generation": golden_grid.generation_record(arch),
    })  # fmt: skip
    want = {k: record[k] for k in ("arch", "setups", "generation")}
    assert _first_difference(got, want) is None, _first_difference(got, want)


@pytest.mark.parametrize("name", sorted(GOLDEN["plans"]))
def test_every_plan_gives_the_recorded_setup_and_numbers(name):
    arch = golden_grid.architecture({"catalog": name})
    want = GOLDEN["plans"][name]
    got = golden_grid.normalized(
        [{"request": r["request"], **golden_grid.plan_record(arch, r["request"])} for r in want]
    )
    assert _first_difference(got, want) is None, _first_difference(got, want)


def test_the_grid_is_broad():
    """Every catalog model, the families, CPU and CUDA, MoE, plans on one and several devices, long contexts."""
    from lowmem_ft.memory.arch import catalog

    assert {f"{n}" for n in catalog()} <= set(GOLDEN["models"])
    assert sum(len(m["setups"]) for m in GOLDEN["models"].values()) > 3000
    assert golden_grid.count_numbers(GOLDEN) > 300_000
    plans = [p for ps in GOLDEN["plans"].values() for p in ps]
    assert {p["request"][1] for p in plans} >= {1, 2, 8} and max(p["request"][4] for p in plans) >= 65536
    assert sum("plan" in p for p in plans) > len(plans) // 2
