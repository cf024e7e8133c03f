"""Qwen2-VL and Qwen3-VL on images: the image-token arithmetic against each checkpoint's Qwen2VLImageProcessorPil
(Qwen3-VL's at patch 16 and a 65,536-pixel floor), the ids and labels against the plain computation, the model's loss
from the collated batch against a plain masked cross-entropy, and `train` measured against the memory model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.vision.data import VisionCollator, load_vision_data
from lowmem_ft.vision.families import VISION_FAMILIES
from tests.vision.conftest import ROWS, write_rows

FAMILIES = {"qwen2-vl": "qwen2_vl", "qwen3-vl": "qwen3_vl"}  # zoo name → model_type
SIZES = [(48, 64), (480, 640), (1080, 1920), (28, 28), (10, 700), (3000, 4000), (57, 113)]


def _images(model: str):
    config = json.loads((Path(model) / "config.json").read_text())
    pre = json.loads((Path(model) / "preprocessor_config.json").read_text())
    return VISION_FAMILIES[config["model_type"]].images(pre, config)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("capped", [False, True])
def test_tokens_per_image_are_the_processors(vl_checkpoint, name, capped):
    import numpy as np
    from transformers import AutoImageProcessor

    model = vl_checkpoint(name)
    processor = AutoImageProcessor.from_pretrained(model)
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    images = _images(model)
    cap = 256 * images.factor**2 if capped else None
    for h, w in SIZES:
        inputs, made = images.process(processor, [[np.zeros((h, w, 3), dtype=np.uint8)]], cap or images.max_pixels)
        assert inputs["pixel_values"].shape == (images.patches(h, w, cap), images.patch_values), (h, w)
        assert made == [images.tokens(h, w, cap)], (h, w)
    if name == "qwen3-vl":  # 16-pixel patches, 32-pixel tokens, at least 65,536 pixels (64 tokens)
        assert images.factor == 32 and images.patch_values == 1536 and images.tokens(48, 64) == 70
        assert images.max_tokens() == 16384
    else:
        assert images.tokens(480, 640) == 391 and images.max_tokens() == 16384


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ids_labels_and_loss_are_the_plain_computation(vl_checkpoint, vlm_data, name):
    """input_ids = the template rendered by transformers with each <|image_pad|> repeated grid_t·h·w / 4 times (the
    processor's grid); labels = exactly the answers' tokens; the model's loss from the collated batch = the mean
    cross-entropy at exactly those positions, by hand from its logits."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model_dir = vl_checkpoint(name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    images = _images(model_dir)
    data = load_vision_data(vlm_data, tokenizer, images, max_pixels=images.max_pixels, max_seq_len=4096)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(data.records) == len(ROWS)
    for row, sample in zip(ROWS, data.records, strict=True):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        for image in row["images"]:
            pixels = np.asarray(Image.open(vlm_data.parent / image).convert("RGB"))
            grid = processor(images=[pixels])["image_grid_thw"]
            text = text.replace("<|image_pad|>", "<|IMG|>" * (int(np.prod(grid[0])) // 4), 1)
        expected = tokenizer(text.replace("<|IMG|>", "<|image_pad|>"), add_special_tokens=False)["input_ids"]
        assert sample["input_ids"] == expected
        learned = [t for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != -100]
        answers = [m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
                   for m in row["messages"] if m["role"] == "assistant"]  # fmt: skip
        assert learned == tokenizer("".join(a + "<|im_end|>" for a in answers), add_special_tokens=False)["input_ids"]
        assert sample["input_ids"].count(pad) == sum(sample["image_tokens"]) > 0

    batch = VisionCollator(processor, tokenizer.pad_token_id, images, images.max_pixels, image_token_id=pad)(
        data.records
    )
    assert batch["mm_token_type_ids"].sum() == sum(sum(r["image_tokens"]) for r in data.records)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(**batch)
    logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    picked = labels != -100
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(logits[picked], labels[picked]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_train_on_images_fits_its_prediction(vl_checkpoint, tmp_path, capsys, name):
    """`train --vram 8` on image chats: the loss falls, the adapter is on the language model only, every training
    phase's exact live bytes are within 8 % of the memory model, `generate --image` runs and encodes its prompt as
    computed by hand, and `plan` names the image tokens per sample."""
    from lowmem_ft.cli import main
    from tests.vision.test_vision_train import _argv

    model = vl_checkpoint(name)
    data = write_rows(tmp_path, ROWS, repeat=4)
    assert main(_argv(model, data, tmp_path / "runs", name)) == 0
    run = tmp_path / "runs" / name
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and metrics["last_loss"] < metrics["first_loss"]
    per_sample = json.loads((run / "run.json").read_text())["data"]["vision"]["image_tokens_per_sample"]

    from safetensors import safe_open

    with safe_open(run / "adapter" / "adapter_model.safetensors", "pt") as saved:
        keys = list(saved.keys())
    assert keys and all("language_model" in k for k in keys), [k for k in keys if "language_model" not in k][:3]

    samples = [json.loads(line) for line in (run / "memory.jsonl").read_text().splitlines()]
    phases = [s for s in samples if s.get("phase") in ("forward", "backward", "optimizer")]
    assert {s["phase"] for s in phases} == {"forward", "backward", "optimizer"}
    for s in phases:
        assert abs(s["peak_live_gb"] / s["predicted_peak_live_gb"] - 1) <= 0.08, s

    image = str(tmp_path / "img" / "green.jpg")
    argv = ["generate", str(run), "--prompt", "What colour is it?", "--image", image, "--max-new-tokens", "4"]
    assert main([*argv, "--temperature", "0"]) == 0
    _generate_encodes_as_by_hand(run, model, image)

    capsys.readouterr()
    assert main(["plan", "--vram", "8", "--model", model, "--data", str(data), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (
        plan["vision"]["max_tokens_per_image"] == 1280
        and plan["vision"]["data"]["image_tokens_per_sample"] == per_sample
    )
    assert per_sample["max"] == (12 if name == "qwen2-vl" else 70 + 77)  # red + green: 2×2 + 2×4; 14×20/4 + 14×22/4


def _generate_encodes_as_by_hand(run: Path, base: str, image: str) -> None:
    """`generate --image`'s prompt (`ImagePrompt.encode`, the run's saved processor at its cap) = the template with
    <|image_pad|> repeated grid_t·h·w / 4 times, mm_token_type_ids 1 exactly there, the processor's pixel values."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from lowmem_ft.vision.generate import ImagePrompt

    tok = AutoTokenizer.from_pretrained(run / "adapter")
    config = json.loads((Path(base) / "config.json").read_text())
    saved = json.loads((run / "adapter" / "preprocessor_config.json").read_text())
    family = VISION_FAMILIES[config["model_type"]]
    processor = AutoImageProcessor.from_pretrained(run / "adapter")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    ours = ImagePrompt(tok, family, family.images(saved, config), processor, [image]).encode(messages)
    pixels = processor(images=[np.asarray(Image.open(image).convert("RGB"))], return_tensors="pt")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(pixels["image_grid_thw"][0].prod()) // 4))
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    torch.testing.assert_close(ours["input_ids"], ids)
    torch.testing.assert_close(ours["mm_token_type_ids"], (ids == tok.convert_tokens_to_ids("<|image_pad|>")).int())
    torch.testing.assert_close(ours["pixel_values"], pixels["pixel_values"])


@pytest.mark.parametrize(
    ("model", "cap"), [("Qwen/Qwen2-VL-7B-Instruct", 1280 * 28 * 28), ("Qwen/Qwen3-VL-8B-Instruct", 1280 * 32 * 32)]
)
def test_plan_of_the_hub_checkpoint_offline_names_the_cap(capsys, model, cap):
    """From the offline catalog's config.json and preprocessor_config.json: 1280 tokens per image, not the 16,384
    the shipped max_pixels allows."""
    from lowmem_ft.cli import main

    assert main(["plan", "--vram", "24", "--model", model, "--json"]) == 0
    vision = json.loads(capsys.readouterr().out)["vision"]
    assert vision["max_pixels"] == cap and vision["max_tokens_per_image"] == 1280
    assert "would let one image become 16384 tokens" in vision["why"]
