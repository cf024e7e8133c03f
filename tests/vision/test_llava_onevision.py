"""LLaVA-OneVision (`lowmem_ft.vision.llava_onevision`) against transformers: the anyres grid and token count
against the image processor and `LlavaOnevisionProcessor` at several sizes, alone and two to a sample, the sample's
ids against the processor's own expansion, labels on the answers only, and the model's loss on a collated batch
against a plain cross-entropy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.vision.data import VisionCollator, load_vision_data
from lowmem_ft.vision.families import VISION_FAMILIES
from tests.vision.conftest import ROWS, adapter_keys, phases_within_prediction, write_rows

# (height, width): within one crop, one crop exactly, wide, tall, extreme aspect ratios, large
SIZES = [(48, 64), (28, 28), (20, 30), (480, 640), (700, 10), (10, 700), (57, 113), (100, 60), (84, 84), (3000, 4000)]
TEXT_ONLY = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}


def _load(model: str):
    from transformers import AutoTokenizer

    config = json.loads((Path(model) / "config.json").read_text())
    preprocessor = json.loads((Path(model) / "preprocessor_config.json").read_text())
    return VISION_FAMILIES["llava_onevision"].images(preprocessor, config), AutoTokenizer.from_pretrained(model)


def _processor(model: str, tokenizer):
    """LlavaOnevisionProcessor without its video processor, which needs torchvision (not loadable here): its
    __init__ builds that; the image path of __call__ needs only these attributes."""
    from transformers import AutoImageProcessor, LlavaOnevisionProcessor

    kwargs = json.loads((Path(model) / "processor_config.json").read_text())
    processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    processor.__dict__.update(
        image_processor=AutoImageProcessor.from_pretrained(model), tokenizer=tokenizer, video_processor=None,
        num_image_tokens=kwargs["num_image_tokens"], vision_aspect_ratio=kwargs["vision_aspect_ratio"],
        vision_feature_select_strategy=kwargs["vision_feature_select_strategy"], image_token="<image>",
        video_token="<video>", image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<video>"), chat_template=None,
    )  # fmt: skip
    return processor


def test_tokens_and_crops_are_the_processors(llava_onevision):
    """A sample's one image: the grid's crops + the base (LlavaOnevisionImageProcessorPil) and the <image> count
    LlavaOnevisionProcessor writes (unpadded, pooled past anyres_max_2, a newline per row, the base crop); two
    images in a sample: the base crop each and side² + 1 tokens."""
    import numpy as np

    images, tokenizer = _load(llava_onevision)
    processor = _processor(llava_onevision, tokenizer)
    assert type(processor.image_processor).__name__ == "LlavaOnevisionImageProcessorPil"
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    for h, w in SIZES:
        picture = np.zeros((h, w, 3), dtype=np.uint8)
        one = processor(text=["<image>"], images=[picture], return_tensors="np")
        assert one["input_ids"][0].tolist().count(image_id) == images.tokens(h, w), (h, w)
        assert one["pixel_values"].shape[1] == images.crops(h, w) == (lambda r, c: r * c + 1)(*images.grid(h, w))
        two = processor(text=["<image><image>"], images=[[picture, picture]], return_tensors="np")
        assert two["input_ids"][0].tolist().count(image_id) == 2 * images.tokens(h, w, images_in_sample=2) == 10
    assert {images.grid(h, w) for h, w in SIZES} >= {(1, 1), (3, 3), (2, 3), (1, 3), (3, 1)}
    assert images.max_tokens() == 16


def test_ids_are_the_processors_and_the_loss_a_plain_cross_entropy(llava_onevision, tmp_path):
    """input_ids = the processor's on the template's text; labels = exactly the answers with <|im_end|>; the model's
    loss on a batch with one, two and no image = the mean cross-entropy at exactly those positions."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    data = write_rows(tmp_path, [*ROWS, TEXT_ONLY])
    images, tokenizer = _load(llava_onevision)
    loaded = load_vision_data(data, tokenizer, images,
                              max_pixels=images.max_pixels, max_seq_len=4096)  # fmt: skip
    processor = _processor(llava_onevision, tokenizer)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    for row, sample in zip([*ROWS, TEXT_ONLY], loaded.records, strict=True):
        messages = [
            {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m["content"], str) else m
            for m in row["messages"]
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        if row.get("images"):
            pictures = [Image.open(tmp_path / name).convert("RGB") for name in row["images"]]
            expected = processor(text=[text], images=[pictures])["input_ids"][0]
        else:
            expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert sample["input_ids"] == expected
        learned = [t for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != -100]
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        answers = ["".join(p["text"] for p in a) if isinstance(a, list) else a for a in answers]
        assert learned == tokenizer("".join(f"\n{a}<|im_end|>" for a in answers), add_special_tokens=False)["input_ids"]
        assert image_id not in learned

    batch = VisionCollator(AutoImageProcessor.from_pretrained(llava_onevision), tokenizer.pad_token_id, images,
                           images.max_pixels)(loaded.records)  # fmt: skip
    assert batch["pixel_values"].shape[:2] == (4, 7) and batch["batch_num_images"].tolist() == [1, 2, 1]
    model = AutoModelForImageTextToText.from_pretrained(llava_onevision, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(**batch)
    logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    picked = labels != -100
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(logits[picked], labels[picked]))


@pytest.mark.slow
def test_train_on_images_fits_its_prediction(llava_onevision, tmp_path, capsys):
    """train --vram 8 on the CPU: loss falls, the adapter on the language model only, every phase within 8 %, and
    `plan` says the grids are fixed by the pinpoints."""
    from lowmem_ft.cli import main
    from tests.vision.test_vision_train import _argv

    data = write_rows(tmp_path, ROWS, repeat=4)
    assert main(_argv(llava_onevision, data, tmp_path / "runs", "ov")) == 0
    run = tmp_path / "runs" / "ov"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and metrics["last_loss"] < metrics["first_loss"]
    vision = json.loads((run / "run.json").read_text())["data"]["vision"]
    assert vision["image_tokens_per_sample"] == {"p50": 12, "p99": 12, "max": 12}

    keys = adapter_keys(run)
    assert keys and all("language_model" in k for k in keys), [k for k in keys if "language_model" not in k][:3]
    phases_within_prediction(run)

    capsys.readouterr()
    assert main(["plan", "--vram", "8", "--model", llava_onevision, "--data", str(data)]) == 0
    assert "fixed by image_grid_pinpoints: up to 3×3 crops of 28 px + the base" in capsys.readouterr().out
