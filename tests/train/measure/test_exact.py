"""Exact CPU memory of a run (lowmem_ft/train/measure/exact.py): what it observes to predict each sample, and the check every
end-to-end test's runs go through (tests/conftest.py, tests/train/tiny_runs.py `memory_disagreements`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from lowmem_ft.memory.estimate import GB, phase_peak_bytes
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.measure.exact import ExactMemory
from tests.train.tiny_runs import FAST, memory_disagreements


def test_samples_are_predicted_for_what_was_alive_and_the_batch_that_ran(tiny_model):
    from lowmem_ft.train.model import build_model

    recipe = resolve("8gb", [f"model.name_or_path={tiny_model}", *FAST])
    exact = ExactMemory.for_recipe(recipe, eval_batch=2)
    model = build_model(recipe)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    exact.start(model, optimizer)
    try:
        ids = torch.randint(0, 500, (3, 20))

        def predicted(phase, rows, tokens, **alive):
            s = replace(exact.setup, micro_batch_size=rows, max_seq_len=tokens)
            return round(phase_peak_bytes(exact.arch, s, phase, **alive) / GB, 6)

        model(input_ids=ids).logits.sum().backward()
        first = exact.read("forward")  # the forward hook samples after the forward; here, after the backward too
        assert first["batch"] == [3, 20]
        assert first["predicted_peak_live_gb"] == predicted("forward", 3, 20, grads=False, states=False)
        assert 0 < first["live_gb"] <= first["peak_live_gb"]
        model(input_ids=ids[:2, :10])  # a second micro batch: the first one's gradients are alive
        assert exact.read("forward")["predicted_peak_live_gb"] == predicted("forward", 2, 10, states=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids)  # the next optimizer step: states, and no gradients yet
        assert exact.read("forward")["predicted_peak_live_gb"] == predicted("forward", 3, 20, grads=False)
        assert exact.read("optimizer")["predicted_peak_live_gb"] == predicted("optimizer step", 3, 20)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids[:1])
        assert exact.read("eval_forward")["batch"] == [1, 20]
        assert exact.read("eval_forward")["predicted_peak_live_gb"] == predicted("eval", 1, 20)
        assert set(exact.read("save")) == {"live_gb", "peak_live_gb"}  # saves hold no activations: no prediction
    finally:
        exact.stop()
    assert exact.read("forward") == {}  # stopped: nothing is counted any more
    start = exact.start_fields()
    assert start["exact"] and start["predicted_cpu_batch"] == [4, 48]
    assert start["predicted_cpu_peak_gb"] >= max(start["predicted_cpu_phases_gb"].values())


def write_run(path, samples):
    path.mkdir(parents=True)
    records = [{"event": "start", "step": 0, "exact": True}, *samples]
    (path / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def sample(phase, measured, predicted=None):
    record = {"step": 1, "phase": phase, "live_gb": measured / 2, "peak_live_gb": measured}
    return record | ({"predicted_peak_live_gb": predicted} if predicted is not None else {})


def test_the_check_fails_a_run_the_model_gets_wrong(tmp_path):
    """The per-test check must be able to fail: off by more than 8 % in one phase, or a save above the peak."""
    write_run(tmp_path / "good", [sample("forward", 1.0, 1.05), sample("optimizer", 0.5, 0.48)])
    assert memory_disagreements(tmp_path / "good") == []
    write_run(tmp_path / "bad", [sample("forward", 1.0, 1.05), sample("optimizer", 0.5, 0.40), sample("save", 1.2)])
    problems = memory_disagreements(tmp_path / "bad")
    assert len(problems) == 2
    assert "optimizer measured 0.500000 GB vs predicted 0.400000 GB (+25.0%)" in problems[0]
    assert "save peaked at 1.200000 GB, above the training peak" in problems[1]
    (tmp_path / "bad" / "memory.jsonl").unlink()  # this test's own files are not a run's: the hook checks tmp_path


@pytest.mark.memory_unchecked(reason="checks that the per-test check itself reports a disagreement")
def test_a_test_may_opt_out_saying_why(tmp_path):
    write_run(tmp_path / "bad", [sample("forward", 1.0, 2.0)])
    assert memory_disagreements(tmp_path) != []


def test_fixtures_runs_are_checked_too(request, tmp_path_factory):
    """A run made in a `tmp_path_factory` directory (a module or session fixture's) is found among the fixtures'
    directories the hook checks after the test, and its disagreement is reported."""
    from tests import conftest

    made = tmp_path_factory.mktemp("fixture_made")
    write_run(made / "bad", [sample("forward", 1.0, 2.0)])
    assert made in conftest._fixture_dirs(request.config)
    problems = conftest._disagreements(conftest._memory_files(made))
    assert problems and "forward measured 1.000000 GB vs predicted 2.000000 GB (-50.0%)" in problems[-1]
    (made / "bad" / "memory.jsonl").unlink()  # not a real run: the hook would fail this test on it
