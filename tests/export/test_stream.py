"""The streamed merge equals peft's `merge_and_unload` for the adapter variants lowmem-ft trains: DoRA, rsLoRA,
an embedding LoRA, and a module saved whole — tensor by tensor, in fp32, blocks smaller than a tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lowmem_ft.export import stream
from tests.saved_adapters import save_adapter


@pytest.mark.parametrize(
    "variant",
    [
        {"use_dora": True},
        {"use_rslora": True, "alpha_pattern": {"v_proj": 32}},
        {"targets": ("q_proj", "embed_tokens")},
        {"modules_to_save": ["lm_head"]},
    ],
    ids=["dora", "rslora-alpha-pattern", "embedding", "modules-to-save"],
)
def test_streamed_merge_equals_peft(variant, zoo_models, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = Path(zoo_models["qwen2.5"])  # untied: lm_head is its own tensor
    kwargs = dict(variant)
    targets = kwargs.pop("targets", ("q_proj", "v_proj", "down_proj"))
    torch.manual_seed(0)
    adapter = save_adapter(str(base), tmp_path / "a", targets=targets, init_lora_weights=False, **kwargs)
    if "modules_to_save" in variant:  # a trained head: not the base's copy
        from safetensors.torch import load_file, save_file

        path = adapter / "adapter_model.safetensors"
        weights = load_file(path)
        key = next(k for k in weights if "lm_head" in k)
        weights[key] = weights[key] + 0.5
        save_file(weights, path, metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    expected = PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()
    monkeypatch.setattr(stream, "BLOCK_ELEMENTS", 1000)  # several blocks per tensor
    loaded = stream.Adapter(adapter)
    changed = 0
    base_weights = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    for ref in stream.tensors(base):
        got = torch.cat([b.reshape(-1, *ref.shape[1:]) for b in stream.merged_blocks(ref, loaded)]).reshape(ref.shape)
        torch.testing.assert_close(got, expected[ref.name], atol=1e-6, rtol=1e-5, msg=ref.name)
        changed += not torch.equal(got, base_weights[ref.name])
    assert changed >= 1
