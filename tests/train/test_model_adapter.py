"""`train/model.py`'s `load_adapter`: an existing adapter through the single build path, trainable and in fp32."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lowmem_ft.choosing import choose_recipe
from lowmem_ft.errors import UserError
from lowmem_ft.train.model import build_model
from tests.saved_adapters import save_adapter


def _nonzero_b(adapter):
    """Give lora_B nonzero values (peft saves it as zeros), so that loading them can be told from a fresh init."""
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    from safetensors.torch import save_file

    save_file({k: (torch.full_like(t, 0.01) if "lora_B" in k else t).to(torch.bfloat16) for k, t in tensors.items()},
              str(path))  # fmt: skip
    return load_file(path)


def test_the_saved_weights_load_trainable_in_fp32_on_a_frozen_base(tiny_model, tmp_path):
    adapter = save_adapter(tiny_model, tmp_path / "qv", r=4)
    saved = _nonzero_b(adapter)  # stored in bf16, as other tools save adapters
    recipe, _ = choose_recipe(vram_gb=None, recipe="8gb", overrides={"adapter": {"name_or_path": str(adapter)}})
    model = build_model(recipe)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == len(saved) == 8
    for name, param in trainable.items():
        key = name.replace(".default", "")
        assert param.dtype == torch.float32  # peft's autocast_adapter_dtype, as for a new adapter
        assert torch.equal(param.detach(), saved[key].float()), name
    assert all("lora_" in n for n in trainable)


def test_an_adapter_that_does_not_fit_the_model_is_one_line(tiny_model, tmp_path):
    from dataclasses import replace

    adapter = save_adapter(tiny_model, tmp_path / "qv", r=4)
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = torch.zeros(4, 7)
    from safetensors.torch import save_file

    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    recipe, _ = choose_recipe(vram_gb=None, recipe="8gb", overrides={"adapter": {"name_or_path": str(adapter)}})
    with pytest.raises(UserError, match=r"does not fit .*: model\.layers\.\d\.self_attn\.(q|v)_proj is 7 → "):
        build_model(replace(recipe, memory=replace(recipe.memory, gradient_checkpointing=False)))
