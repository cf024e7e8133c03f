"""Planning a GRPO run (lowmem_ft/memory/grpo_plan.py): every phase within the budget, rounds of whole prompt groups
as TRL requires, the round's length and width stepped down only where the user did not fix them; `plan` prints
each phase and the one that peaks."""

from __future__ import annotations

import pytest

from lowmem_ft.choosing import choose_recipe
from lowmem_ft.cli import main
from lowmem_ft.errors import UserError
from lowmem_ft.memory.grpo import peak_phase

LLAMA = "meta-llama/Llama-3.1-8B"  # the offline catalog's architecture: planned without weights

pytestmark = pytest.mark.memory_unchecked(reason="planning only: no training run")


def _choose(vram: float, **grpo):
    overrides = {"model": {"name_or_path": LLAMA}, "training": {"method": "grpo"}}
    if grpo:
        overrides["grpo"] = grpo
    return choose_recipe(vram_gb=vram, recipe=None, overrides=overrides)


@pytest.mark.parametrize("vram", [8, 24, 40])
def test_every_phase_fits_and_the_round_holds_whole_prompt_groups(vram):
    recipe, choice = _choose(vram)
    est, g, m = choice.plan.estimate, recipe.grpo, recipe.memory
    assert set(est.phases) >= {"generation", "forward", "backward", "optimizer step"}
    assert est.peak_phase == peak_phase(est.phases) and choice.plan.fits
    assert est.peak_bytes <= choice.plan.budget_gb * 1e9
    spg = g.steps_per_generation
    assert (m.micro_batch_size * spg) % g.num_generations == 0  # TRL's GRPOConfig check (one process)
    assert m.gradient_accumulation % spg == 0  # aligned: no old-policy pass
    assert "scoring" not in est.phases  # beta 0 and aligned rounds: TRL scores nothing apart


def test_a_round_too_large_steps_down_what_the_user_did_not_fix():
    recipe, choice = _choose(8, max_completion_length=1024)  # C fixed: kept
    assert recipe.grpo.max_completion_length == 1024 and "round" not in choice.reasons
    with pytest.raises(UserError, match="no round fits the 7.25 GB budget .* peak in generation"):
        _choose(8, max_completion_length=1024, num_generations=16)  # both fixed: nothing may give
    recipe, choice = choose_recipe(
        vram_gb=8, recipe=None, overrides={"model": {"name_or_path": LLAMA}, "training": {"method": "grpo"},
                                           "memory": {"gradient_accumulation": 16}},
    )  # fmt: skip
    assert recipe.memory.gradient_accumulation == 16


def test_unfixed_completion_length_is_halved_and_said(monkeypatch):
    """A tier's C that does not fit is halved (the user did not set it), and the plan says so."""
    from lowmem_ft import choosing

    real = choosing.start_recipe

    def long_tier(*args, **kwargs):
        from dataclasses import replace

        r = real(*args, **kwargs)
        return replace(r, grpo=replace(r.grpo, max_completion_length=8192, num_generations=16))

    monkeypatch.setattr(choosing, "start_recipe", long_tier)
    recipe, choice = _choose(8)
    assert recipe.grpo.max_completion_length < 8192 or recipe.grpo.num_generations < 16
    assert "stepped down to fit" in choice.reasons["round"]


def test_plan_prints_each_phase_and_the_peak(capsys):
    assert main(["plan", "--vram", "24", "--model", LLAMA, "--method", "grpo"]) == 0
    out = capsys.readouterr().out
    lines = out.split("GRPO phases")[1].splitlines()[1:5]
    assert [line.split()[0] for line in lines] == ["generation", "forward", "backward", "optimizer"]
    assert sum("← peak" in line for line in lines) == 1
    assert "steps_per_generation:" in out


def test_plan_json_carries_each_phase(capsys):
    import json

    assert main(["plan", "--vram", "24", "--model", LLAMA, "--method", "grpo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    phases = out["phases_gb"]
    assert set(phases) >= {"generation", "forward", "backward", "optimizer step"}
    assert max(phases.values()) == pytest.approx(out["predicted_peak_gb"], abs=2e-3)
    assert out["peak_phase"] == max(phases, key=phases.get) and out["recipe"]["grpo"]["steps_per_generation"] > 0
