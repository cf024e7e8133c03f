"""LoRA variants through peft: rsLoRA's scaling and LoRA+'s learning rates reach the model and the optimizer, and
neither changes the memory plan (both are memory-neutral: read from peft's code)."""

from __future__ import annotations

import math

from tiny_runs import tiny_trainer

from lowmem_ft.choosing import setup_from_recipe
from lowmem_ft.recipe.load import resolve


def test_rslora_scales_by_the_root_of_the_rank_and_loraplus_speeds_up_lora_b(tiny_model, chat_data, tmp_path):
    ft = tiny_trainer(tiny_model, chat_data, tmp_path, "adapter.r=4", "adapter.alpha=8", "adapter.use_rslora=true",
                      "optimizer.loraplus_lr_ratio=16", "optimizer.lr=1e-4")  # fmt: skip
    layer = next(m for m in ft.trainer.model.modules() if isinstance(getattr(m, "scaling", None), dict))
    assert math.isclose(layer.scaling["default"], 8 / math.sqrt(4))  # plain LoRA: 8 / 4
    optimizer = ft.trainer.create_optimizer()
    lrs = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            lrs[id(p)] = group["lr"]
    names = {id(p): n for n, p in ft.trainer.model.named_parameters() if p.requires_grad}
    assert set(lrs) == set(names)  # every trainable parameter, once
    assert {lrs[i] for i, n in names.items() if "lora_B" in n} == {1.6e-3}
    assert {lrs[i] for i, n in names.items() if "lora_A" in n} == {1e-4}


def test_rslora_and_loraplus_leave_the_setup_as_it_was():
    plain = resolve("8gb", {})
    variant = resolve("8gb", {"adapter": {"use_rslora": True}, "optimizer": {"loraplus_lr_ratio": 16}})
    assert setup_from_recipe(variant) == setup_from_recipe(plain)
