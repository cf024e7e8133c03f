"""`--verify`: traced against predicted per phase, the summary line, the step down when the trace is over the budget,
and the one-line refusals."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from lowmem_ft.cli import main
from lowmem_ft.memory.estimate import GB
from lowmem_ft.train import verify as verify_module
from lowmem_ft.train.verify import Verification, verified


def _plan(peak_gb: float, budget_gb: float, margin_gb: float = 1.0):
    return SimpleNamespace(
        estimate=SimpleNamespace(peak_bytes=peak_gb * GB, peak_gb=peak_gb), budget_gb=budget_gb, margin_gb=margin_gb
    )


def test_over_the_budget_the_planner_steps_down_with_the_excess_as_margin(monkeypatch):
    """A trace 2 GB above the prediction puts a plan predicted at 9.5 GB at 11.5 GB, over a 10 GB budget: the
    planner plans again with the margin raised by the excess (and a little more), and traces that plan."""
    traces = iter([(12.0, 10.0), (8.0, 8.0)])  # (traced peak, predicted peak) GB of the two plans

    def fake_verify(recipe, arch, plan_peak_bytes=None):
        traced, predicted = next(traces)
        return Verification({"backward": int(traced * GB)}, {"backward": predicted * GB}, 1.0, plan_peak_bytes)

    monkeypatch.setattr(verify_module, "verify", fake_verify)
    monkeypatch.setattr("lowmem_ft.memory.arch.load_architecture", lambda *a: None)
    margins, said = [], []
    recipe = SimpleNamespace(model=SimpleNamespace(name_or_path="m", trust_remote_code=False))
    second = SimpleNamespace(plan=_plan(8.5, 10.0, 2.55))

    def plan_again(margin):
        margins.append(margin)
        return recipe, second

    _, choice, result = verified(recipe, SimpleNamespace(plan=_plan(9.5, 10.0)), plan_again, said.append)
    assert margins == [pytest.approx(1.0 + 1.5 + 0.05)] and choice is second
    assert result.device_peak == pytest.approx(8.5 * GB)
    assert any("over the budget of 10.00 GB by 1.50 GB: stepping down" in line for line in said)
    assert said[-1].startswith("traced 8.00 GB, predicted 8.00 GB (+0.0%)")


def test_lines_are_one_per_phase_then_the_summary():
    v = Verification(
        {"static": 10 * GB, "backward": 20 * GB, "eval": 15 * GB},
        {"static": 10 * GB, "backward": 20.2 * GB, "eval": 15 * GB},
        42.0,
    )
    lines = v.lines()
    assert len(lines) == 4 and "backward" in lines[1] and "(+1.0%)" in lines[1]
    assert re.match(r"traced 20\.00 GB, predicted 20\.20 GB \(\+1\.0%\)", lines[-1])


@pytest.mark.slow
def test_plan_verify_on_a_zoo_model_prints_traced_against_predicted(zoo_models, capsys):
    assert main(["plan", "--model", zoo_models["qwen2.5"], "--vram", "8", "--verify", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    for phase in ("static", "forward", "backward", "optimizer step", "eval"):
        assert re.search(rf"^  {phase}\s+traced", out, re.M), phase
    summary = re.search(r"^traced ([\d.]+) GB, predicted ([\d.]+) GB \(([+-][\d.]+)%\)", out, re.M)
    assert summary and abs(float(summary.group(3))) <= 2.0


def test_verify_refuses_several_gpus_in_one_line(tiny_model, capsys):
    assert main(["plan", "--model", tiny_model, "--vram", "8", "--gpus", "2", "--verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--verify traces one device's step" in err[0]


def test_train_verify_without_vram_is_refused_in_one_line(tiny_model, chat_data, tmp_path, capsys):
    args = ["train", "--model", tiny_model, "--data", chat_data, "--recipe", "8gb", "--output-dir", str(tmp_path)]
    args.append("--verify")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--verify traces the plan for one device: give --vram GB" in err[0]
