"""Rank 0 of an FSDP2 step traced in one process on a fake process group (`lowmem_ft.train.trace.sharded`): equal to
the real rank 0 of a gloo run (`devkit.harness.fsdp`, the same accelerate sharding), and extrapolated by depth
exactly; `--verify --gpus N` refuses what it cannot trace in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from devkit.harness.estimator import Point, recipe_for
from devkit.harness.fsdp import FsdpPoint, measure
from lowmem_ft.errors import UserError
from lowmem_ft.train.trace import sharded


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "adapter"),
    [
        ("qwen2.5", "full"),  # untied: the input embedding is a unit of its own; the root's gradients reduce-scattered
        ("llama3", "qlora"),  # tied; 4-bit weights gathered in their float storage, LoRA beside them
    ],
)
def test_rank0_trace_equals_the_real_gloo_rank0_to_the_byte(zoo_models, family, adapter):
    model_dir = Path(zoo_models[family])
    p = FsdpPoint(family, adapter, 2, False, batch=2, seq=64)
    real = measure(model_dir, p)[0]
    real.pop("peak")
    traced = sharded.trace_rank(recipe_for(model_dir, p.point()), 2, precision="no", whole=True)
    assert traced.depth is None
    assert traced.marks == real


@pytest.mark.slow
def test_extrapolated_by_depth_equals_traced_whole_at_two_ranks(zoo_models):
    """Under the product's sharding and mixed precision (bf16 units, an untied embedding unit), a 9-layer model
    traced at two smaller depths and extrapolated gives every mark of the whole trace."""
    from transformers import AutoConfig

    model_dir = Path(zoo_models["qwen2.5"])
    recipe = recipe_for(model_dir, Point("qwen2.5", "lora", "adamw_torch", True, 2, 32))
    spec = json.loads((model_dir / "config.json").read_text())
    spec.pop("layer_types", None)
    config = AutoConfig.for_model(**{**spec, "num_hidden_layers": 9})
    whole = sharded.trace_rank(recipe, 2, config, whole=True, precision="bf16")
    parts = sharded.trace_rank(recipe, 2, config, precision="bf16")
    assert parts.depth is not None and parts.depth.total == 9 and parts.depth.traced[1] < 9
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
