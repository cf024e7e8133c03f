"""Rank 0 of an FSDP2 step traced in one process on a fake process group (`lowmem_ft.train.trace.sharded`):
extrapolated by depth exactly; `--verify --gpus N` refuses what it cannot trace in one line. That the trace equals
the real rank 0 of a gloo run (`devkit.harness.fsdp`, the same accelerate sharding) is checked on the harness's own
runs, tests/devkit/test_harness_fsdp.py, so each run is made once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from devkit.harness.estimator import Point, recipe_for
from lowmem_ft.errors import UserError
from lowmem_ft.train.trace import sharded


@pytest.mark.slow
def test_extrapolated_by_depth_equals_traced_whole_at_two_ranks(zoo_models, monkeypatch):
    """Under the product's sharding and mixed precision (bf16 units, an untied embedding unit), a model traced at two
    smaller depths and extrapolated gives every mark of the whole trace: at the least depth that extrapolates (the
    tracer's saving margin set to 0, as tests/train/trace/test_layers_families.py does), 2 and 3 layers to 5."""
    from transformers import AutoConfig

    monkeypatch.setattr("lowmem_ft.train.trace.layers.SAVING", 0)

    model_dir = Path(zoo_models["qwen2.5"])
    recipe = recipe_for(model_dir, Point("qwen2.5", "lora", "adamw_torch", True, 2, 32))
    spec = json.loads((model_dir / "config.json").read_text())
    spec.pop("layer_types", None)
    config = AutoConfig.for_model(**{**spec, "num_hidden_layers": 5})
    whole = sharded.trace_rank(recipe, 2, config, whole=True, precision="bf16")
    parts = sharded.trace_rank(recipe, 2, config, precision="bf16")
    assert parts.depth is not None and parts.depth.total == 5 and parts.depth.traced == (2, 3)
    assert parts.marks == whole.marks


@pytest.mark.parametrize(
    ("strategy", "said"),
    [("ddp", "traces FSDP plans only (--strategy fsdp); the plan is ddp"), ("zero3", "the plan is zero3")],
)
def test_what_cannot_be_traced_is_refused_in_one_line(tiny_model, strategy, said):
    recipe = recipe_for(Path(tiny_model), Point("tiny", "lora", "adamw_torch", False, 1, 32))
    with pytest.raises(UserError, match=re.escape(said)) as caught:
        sharded.check(recipe, 4, strategy)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_plan_verify_traces_one_fsdp_rank_and_prints_it_beside_the_prediction(zoo_models, capsys):
    from lowmem_ft.cli import main

    argv = ["plan", "--model", zoo_models["qwen2.5"], "--vram", "8", "--gpus", "2", "--strategy", "fsdp", "--verify",
            "--seq-len", "64", "--set", "memory.gradient_checkpointing=true"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    for phase in ("static", "forward", "backward", "optimizer step"):
        assert re.search(rf"^  {phase}\s+traced", out, re.M), phase
    summary = re.search(r"^traced [\d.]+ GB, predicted [\d.]+ GB \(([+-][\d.]+)%\).*rank 0 of 2 \(FSDP2\)", out, re.M)
    assert summary and abs(float(summary.group(1))) <= 1.0
