"""LLaVA-1.5 (`lowmem_ft.vision.llava`) against transformers: the fixed crop and its 576 (tiny: 16) tokens against
the image processor at several sizes, the sample's ids against `LlavaProcessor`'s own expansion, labels on the
answers only, and the model's loss on a collated batch against a plain cross-entropy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.vision.data import VisionCollator, load_vision_data
from lowmem_ft.vision.families import VISION_FAMILIES
from tests.vision.conftest import ROWS, adapter_keys, phases_within_prediction, write_rows

SIZES = [(48, 64), (56, 56), (20, 30), (480, 640), (700, 10), (3000, 4000)]


def _load(model: str):
    from transformers import AutoTokenizer

    config = json.loads((Path(model) / "config.json").read_text())
    images = VISION_FAMILIES["llava"].images(json.loads((Path(model) / "preprocessor_config.json").read_text()), config)
    return images, AutoTokenizer.from_pretrained(model)


def _processor(model: str, tokenizer):
    from transformers import AutoImageProcessor, LlavaProcessor

    kwargs = json.loads((Path(model) / "processor_config.json").read_text())
    kwargs.pop("processor_class")
    return LlavaProcessor(AutoImageProcessor.from_pretrained(model), tokenizer, **kwargs)


def test_tokens_are_the_processors_at_any_size(llava):
    """Every image is the crop (CLIPImageProcessorPil: shortest edge, then center crop) and LlavaProcessor writes
    the same count of <image> for it: (56 / 14)² = 16 here, 576 for the published 336 / 14."""
    import numpy as np

    images, tokenizer = _load(llava)
    processor = _processor(llava, tokenizer)
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    for h, w in SIZES:
        out = processor(text=["<image>"], images=[np.zeros((h, w, 3), dtype=np.uint8)], return_tensors="np")
        assert out["pixel_values"].shape == (1, 3, images.crop_height, images.crop_width), (h, w)
        assert out["input_ids"][0].tolist().count(tokenizer.convert_tokens_to_ids("<image>")) == images.tokens(h, w)
    assert images.tokens() == 16 and images.caps(1 << 40) == [56 * 56]

    from lowmem_ft.memory.arch import catalog_entry

    _, entry = catalog_entry("llava-hf/llava-1.5-7b-hf")
    published = VISION_FAMILIES["llava"].images(entry["preprocessor"], entry["config"])
    assert published.tokens(
        480, 640
    ) == 576 and "fixed: every image cropped to 336×336, 576 tokens" in published.cap_why(0)


def test_ids_are_the_processors_and_the_loss_a_plain_cross_entropy(llava, tmp_path):
    """input_ids = LlavaProcessor's on the template's text (contents as text parts, as TRL writes them); labels =
    exactly the answers' tokens (the shipped template writes no EOS after an answer); the model's loss on the
    collated batch = the mean cross-entropy at exactly those positions."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    data = write_rows(tmp_path, ROWS)
    images, tokenizer = _load(llava)
    loaded = load_vision_data(data, tokenizer, images, max_pixels=images.max_pixels,
                              max_seq_len=4096)  # fmt: skip
    processor = _processor(llava, tokenizer)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    for row, sample in zip(ROWS, loaded.records, strict=True):
        messages = [
            {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m["content"], str) else m
            for m in row["messages"]
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        pictures = [Image.open(tmp_path / name).convert("RGB") for name in row["images"]]
        expected = processor(text=[text], images=pictures, add_special_tokens=False)["input_ids"][0]
        assert sample["input_ids"] == expected
        learned = [t for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != -100]
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        answers = ["".join(p["text"] for p in a) if isinstance(a, list) else a for a in answers]
        assert tokenizer.decode(learned) == "".join(answers)
        assert image_id not in learned and sample["input_ids"].count(image_id) == 16 * len(row["images"])

    batch = VisionCollator(AutoImageProcessor.from_pretrained(llava), tokenizer.pad_token_id, images,
                           images.max_pixels)(loaded.records)  # fmt: skip
    assert batch["pixel_values"].shape == (4, 3, 56, 56)
    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(**batch)
    logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    picked = labels != -100
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(logits[picked], labels[picked]))


@pytest.mark.slow
def test_train_on_images_fits_its_prediction(llava, tmp_path, capsys):
    """train --vram 8 on the CPU: loss falls, the adapter on the language model only, every phase within 8 %, and
    `plan` says the tokens per image are fixed."""
    from lowmem_ft.cli import main
    from tests.vision.test_vision_train import _argv

    data = write_rows(tmp_path, ROWS, repeat=4)
    assert main(_argv(llava, data, tmp_path / "runs", "llava")) == 0
    run = tmp_path / "runs" / "llava"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and metrics["last_loss"] < metrics["first_loss"]
    vision = json.loads((run / "run.json").read_text())["data"]["vision"]
    assert vision["image_tokens_per_sample"] == {"p50": 16, "p99": 32, "max": 32}

    keys = adapter_keys(run)
    assert keys and all("language_model" in k for k in keys), [k for k in keys if "language_model" not in k][:3]
    phases_within_prediction(run)

    capsys.readouterr()
    assert main(["plan", "--vram", "8", "--model", llava, "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert "fixed: every image cropped to 56×56, 16 tokens" in out and "image tokens per sample p50 16" in out
