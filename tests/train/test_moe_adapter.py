"""LoRA on a mixture of experts through the build path `train` uses: the recipes' names stay on the nn.Linear layers."""

from __future__ import annotations

import logging

import pytest

from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.model import build_model

QWEN3_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
}  # fmt: skip


@pytest.mark.parametrize("targets", [None, ["all-linear"]], ids=["recipe", "all-linear"])
def test_recipe_names_on_qwen3_moe_adapt_the_linears_and_leave_the_experts_frozen(tmp_path, caplog, targets):
    """peft 0.21 turns gate/up/down_proj (and all-linear) into LoRA on Qwen3-MoE's fused expert stacks
    (target_parameters), whose ParamWrapper refuses the recipes' lora_dropout 0.05: `train --recipe 24gb` on
    Qwen3-30B-A3B stopped with "lora.ParamWrapper does not work with lora_dropout != 0". The names now stay on the
    nn.Linear layers (what the memory model counts), with a warning naming the experts left frozen."""
    from devkit.harness.estimator import write_model

    model_dir = write_model(QWEN3_MOE, tmp_path / "m")
    overrides = {"model": {"name_or_path": str(model_dir)}}
    if targets:
        overrides["adapter"] = {"target_modules": targets}
    recipe = resolve("24gb", overrides)
    assert recipe.adapter.dropout > 0
    with caplog.at_level(logging.WARNING, logger="lowmem_ft.train.model"):
        model = build_model(recipe)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all("lora_" in n for n in trainable)
    assert any("experts stay frozen" in r.getMessage() for r in caplog.records)
