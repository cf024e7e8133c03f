"""The ViT towers (`lowmem_ft.memory.vision_towers`) as the memory model counts them, against the models transformers
builds on the meta device: every tower and connector parameter, every nn.Linear (what bitsandbytes quantizes) and
the whole model's total, on the zoo checkpoints and the catalog's published configs."""

from __future__ import annotations

import pytest

from lowmem_ft.memory.arch import Architecture, catalog

# the module names of the tower and connector beside the decoder, per wrapper model_type
BESIDE = {"idefics3": ("vision_model.", "connector."), "smolvlm": ("vision_model.", "connector."),
          "llava": ("vision_tower.", "multi_modal_projector."),
          "llava_onevision": ("vision_tower.", "multi_modal_projector.", "image_newline")}  # fmt: skip


def _config(source: str) -> dict:
    if source in catalog():
        return catalog()[source]["config"]
    from devkit.zoo import FAMILIES, build_tokenizer, config_for

    family = FAMILIES[source]
    return config_for(family, build_tokenizer(family)).to_dict()


@pytest.mark.parametrize(
    "source",
    ["smolvlm", "smolvlm2", "HuggingFaceTB/SmolVLM-Instruct", "llava", "llava-hf/llava-1.5-7b-hf", "llava-onevision"],
)
def test_tower_weights_and_linears_are_transformers(source):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = _config(source)
    arch = Architecture.from_config(config, name=source)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config))
    beside = tuple(f"model.{n}" for n in BESIDE[config["model_type"]])
    tower = [p for n, p in model.named_parameters() if n.startswith(beside)]
    assert arch.tower_params == sum(p.numel() for p in tower) > 0
    assert arch.total_params == sum(p.numel() for p in model.parameters())
    linears = [m for n, m in model.named_modules() if n.startswith(beside) and isinstance(m, torch.nn.Linear)]
    assert sorted((m.in_features, m.out_features) for m in linears) == sorted(
        (lin.in_features, lin.out_features) for lin in arch.tower_linears
    )
    assert arch.vision is not None and arch.model_type in ("llama", "qwen2") and arch.chunked_loss_refusal


def test_smolvlm_instruct_is_its_published_size():
    from lowmem_ft.memory.arch import load_architecture

    arch = load_architecture("HuggingFaceTB/SmolVLM-Instruct")
    assert arch.total_params == 2_246_272_880 and arch.tower_params == 434_220_912
    assert "run frozen on image data" in arch.summary()


def test_llava_1_5_7b_is_its_published_size():
    from lowmem_ft.memory.arch import load_architecture

    arch = load_architecture("llava-hf/llava-1.5-7b-hf")
    assert arch.total_params == 7_063_427_072 and arch.tower_params == 324_487_168


@pytest.mark.parametrize("zoo", ["smolvlm", "llava", "llava-onevision"])
def test_nf4_weights_are_what_bitsandbytes_stores(zoo, zoo_models):
    """Loaded in 4-bit: every nn.Linear but the LM head is NF4, the tower's and the connector's included, so the
    16-bit rest the memory model counts is exactly the other parameters."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.estimate import DTYPE_BYTES, Setup, weight_bytes

    path = Path(next(iter(zoo_models.values()))).parent / zoo
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    quantized = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16, quantization_config=nf4)
    four_bit = {id(m.weight) for m in quantized.modules() if type(m).__name__ == "Linear4bit"}
    rest = sum(p.numel() for p in quantized.parameters() if id(p) not in four_bit)
    _, w_rest, _ = weight_bytes(load_architecture(str(path)), Setup(quantization="nf4", compute_dtype="bfloat16"))
    assert w_rest == rest * DTYPE_BYTES["bfloat16"]
