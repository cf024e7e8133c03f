"""The preference harness on two tiny points (the grid is benchmarks/estimator_preference.md): TRL's own DPO and KTO
steps through the `train` path, measured exactly, each phase within the grid's max-error target (3 %)."""

from __future__ import annotations

import pytest

from devkit.harness.preference import PrefPoint, run_points


@pytest.mark.slow
@pytest.mark.memory_unchecked(reason="built through train, not trained: the harness compares each phase itself")
def test_dpo_and_kto_points_within_the_grids_target(zoo_models):
    points = [
        PrefPoint("llama3", "dpo", "lora", False, 2, 48, loss_type="ipo"),  # the reference pass over the kept tensors
        PrefPoint("qwen2.5", "kto", "full", True, 2, 48, reference="copy"),  # KL batch, a frozen reference copy
    ]
    for p in run_points(points, families=dict(zoo_models)):
        assert p.batch[0] == (4 if p.method == "dpo" else 2) and p.batch[1] <= 48
        measured = p.measured()
        assert measured["backward"] > measured["forward"] > measured["static"] > 0  # beyond the weights
        worst = max(p.errors().values(), key=abs)
        assert abs(worst) <= 0.03, f"{p.label}: {p.errors()}"
