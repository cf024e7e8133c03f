"""The image-token arithmetic against the checkpoint's own image processor, and the one-line refusal of the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.vision.families import vision_family
from lowmem_ft.vision.qwen_vl import QwenVLImages

SIZES = [(48, 64), (480, 640), (1080, 1920), (28, 28), (10, 700), (3000, 4000), (57, 113)]


@pytest.mark.parametrize("max_pixels", [None, 1280 * 28 * 28, 256 * 28 * 28])
def test_tokens_per_image_are_the_processors(qwen_vl, max_pixels):
    """Every (height, width) gives the patch grid Qwen2VLImageProcessorPil makes, at the shipped and capped max_pixels
    (the issue's 640×480 → 34×46 patches, 391 tokens)."""
    import numpy as np
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(qwen_vl)
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    images = QwenVLImages.from_preprocessor(json.loads((Path(qwen_vl) / "preprocessor_config.json").read_text()))
    assert images.max_pixels == 12845056 and images.min_pixels == 3136
    size = {"shortest_edge": images.min_pixels, "longest_edge": max_pixels or images.max_pixels}
    for h, w in SIZES:
        out = processor(images=[np.zeros((h, w, 3), dtype=np.uint8)], size=size, return_tensors="np")
        t, gh, gw = out["image_grid_thw"][0].tolist()
        assert out["pixel_values"].shape == (images.patches(h, w, max_pixels), images.patch_values), (h, w)
        assert t * gh * gw // 4 == images.tokens(h, w, max_pixels), (h, w)
    assert images.tokens(480, 640) == 391 and images.max_tokens() == 16384


def test_other_vlms_are_one_line_naming_their_family():
    assert vision_family("qwen2_5_vl").name == "Qwen2.5-VL" and vision_family("gemma3").name == "Gemma-3"
    with pytest.raises(UserError, match=r"does not train Llama-3.2-Vision on images yet.* supports Qwen2-VL, "):
        vision_family("mllama", "meta-llama/Llama-3.2-11B-Vision-Instruct")
    with pytest.raises(UserError, match=r"does not train model_type 'fancy_vlm' on images"):
        vision_family("fancy_vlm")
    for model_type, why in [("mllama", "cross-attention layers"), ("llava_next", "anyres tiling")]:
        with pytest.raises(UserError, match=rf"does not train \S+ on images yet: .*{why}.* supports .*LLaVA-1.5"):
            vision_family(model_type)


def test_llama_3_2_vision_is_one_line_naming_it_and_why(tmp_path, capsys):
    """Its cross-attention layers read the image beside the sequence: refused before anything loads, exit 2."""
    from lowmem_ft.cli import main

    text = {"model_type": "mllama_text_model", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 100, "intermediate_size": 128, "cross_attention_layers": [1]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mllama", "text_config": text}))
    assert main(["plan", "--vram", "8", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Llama-3.2-Vision" in err[0] and "cross-attention layers" in err[0], err


ZOO_VLMS = ["qwen2.5-vl", "qwen2-vl", "qwen3-vl", "gemma3-vision", "smolvlm", "smolvlm2", "llava", "llava-onevision"]


@pytest.mark.parametrize("name", ZOO_VLMS)
def test_every_family_answers_the_one_protocol(name):
    """Every zoo VLM's model_type has a family whose arithmetic has every `ImageArithmetic` member; its `tokens` are
    the image tokens its expansion holds (what the collator and `generate --image` check against the processor),
    alone and two to a sample, and at most `max_tokens` for an image no smaller than the cap; its caps lie within
    the ceiling; and a saved preprocessor_config.json at a cap reads
    back as `at_cap` (what `generate` of a run resizes with)."""
    from devkit.zoo import FAMILIES
    from lowmem_ft.vision.families import VISION_FAMILIES, ImageArithmetic

    zoo = FAMILIES[name]
    family = VISION_FAMILIES[zoo.config["model_type"]]
    images = family.images(zoo.preprocessor, zoo.config)
    members = {m for m in vars(ImageArithmetic) if not m.startswith("_")} | set(ImageArithmetic.__annotations__)
    assert not [m for m in sorted(members) if not hasattr(images, m)]
    cap, why = images.default_cap()
    assert why.startswith("vision.max_pixels") or "vision.max_pixels does not apply" in why, why
    caps = images.caps(cap)
    assert caps == sorted(caps, reverse=True) and all(c <= cap for c in caps), caps
    for c in caps:
        assert family.images(images.with_cap(zoo.preprocessor, c), zoo.config) == images.at_cap(c), c
        for n in (1, 2):
            for h, w in SIZES:
                tokens = images.tokens(h, w, c, n)
                assert images.expansion(h, w, c, n).count(images.image_token) == tokens > 0, (c, n, h, w)
                # an image smaller than the cap may be enlarged past it: Qwen3-VL's 48 × 64 at its 64-token cap
                # (= min_pixels) rounds up to 7 × 10 merged patches, 70 tokens
                assert tokens <= images.max_tokens(c) or h * w < c, (c, n, h, w)
    assert images.text_inputs is not None and images.placeholder
