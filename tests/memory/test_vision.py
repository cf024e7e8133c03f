"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL's vision tower as the memory model counts it, against the model transformers builds: every parameter
and every nn.Linear (what bitsandbytes quantizes), on the zoo checkpoint and the catalog's 7B config."""

from __future__ import annotations

import pytest

from lowmem_ft.memory.arch import Architecture, catalog, load_architecture


def _model(config: dict):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config))


SOURCES = ["zoo:qwen2.5-vl", "zoo:qwen2-vl", "zoo:qwen3-vl", "Qwen/Qwen2.5-VL-7B-Instruct",
           "Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2-VL-7B-Instruct",
           "Qwen/Qwen3-VL-8B-Instruct"]  # fmt: skip


@pytest.mark.parametrize("source", SOURCES)
def test_tower_weights_and_linears_are_transformers(source, tmp_path):
    """Qwen2.5-VL's windowed tower, Qwen2-VL's LayerNorm / fc1-fc2 one and Qwen3-VL's with position embeddings and
    deepstack mergers, tiny and at the catalog's full size."""
    import torch

    if source.startswith("zoo:"):
        from devkit.zoo import FAMILIES, build_tokenizer, config_for

        family = FAMILIES[source.removeprefix("zoo:")]
        config = config_for(family, build_tokenizer(family)).to_dict()
    else:
        config = catalog()[source]["config"]
    arch = Architecture.from_config(config, name=source)
    model = _model(config)
    visual = [(n, p) for n, p in model.named_parameters() if ".visual." in n]
    assert arch.tower_params == sum(p.numel() for _, p in visual) > 0
    assert arch.total_params == sum(p.numel() for p in model.parameters())
    linears = [m for n, m in model.named_modules() if ".visual." in n and isinstance(m, torch.nn.Linear)]
    assert sorted((m.in_features, m.out_features) for m in linears) == sorted(
        (lin.in_features, lin.out_features) for lin in arch.tower_linears
    )
    assert arch.vision is not None and arch.model_type == f"{config['model_type']}_text"


def test_the_7b_tower_is_its_published_share():
    arch = load_architecture("Qwen/Qwen2.5-VL-7B-Instruct")
    assert arch.total_params == 8_292_166_656 and arch.tower_params == 676_550_144
    small = load_architecture("Qwen/Qwen2.5-VL-3B-Instruct")  # tied embeddings; the merger ends at 2,048
    assert small.total_params == 3_754_622_976 and small.tower_params == 668_684_288
    assert "run frozen on image data" in arch.summary()
    qwen2 = load_architecture("Qwen/Qwen2-VL-7B-Instruct")  # the Hub's safetensors totals; towers counted on meta
    assert qwen2.total_params == 8_291_375_616 and qwen2.tower_params == 675_759_104
    qwen3 = load_architecture("Qwen/Qwen3-VL-8B-Instruct")
    assert qwen3.total_params == 8_767_123_696 and qwen3.tower_params == 576_388_336
