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


@pytest.mark.slow
@pytest.mark.parametrize(("family", "dropout"), [("llama3", 0.05), ("gemma2", 0.0), ("phi3", 0.0)])
def test_lora_under_mixed_precision_is_predicted_per_phase(zoo_models, family, dropout):
    """Under the GPU run's bf16 mixed precision FSDP2 gathers the LoRA weights in bf16 and peft casts no input to
    fp32 (`memory.linears`, `Setup.lora_in_compute_dtype`): rank 0's forward and backward within 1 % of the
    prediction without checkpointing, where the LoRA inputs are kept in every layer (with peft's one-device fp32
    terms: 1.6 to 5.4 % high on the zoo). Families: untied (llama3), sandwich norms (gemma2), fused q/k/v and
    gate/up (phi3); with and without dropout."""
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.recipe.load import resolve

    model = zoo_models[family]
    recipe = resolve(None, {
        "model": {"name_or_path": model, "quantization": "none"}, "adapter": {"kind": "lora", "r": 8, "dropout": dropout},
        "optimizer": {"name": "adamw_torch"},
        "memory": {"gradient_checkpointing": False, "micro_batch_size": 2, "max_seq_len": 256, "gradient_accumulation": 1},
    })  # fmt: skip
    traced = sharded.trace_rank(recipe, 2, precision="bf16").phases
    predicted = sharded.predict_rank(recipe, load_architecture(model), 2, precision="bf16")
    for phase in ("forward", "backward"):
        assert predicted[phase] == pytest.approx(traced[phase], rel=0.01), phase
