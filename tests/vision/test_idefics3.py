"""Idefics3 / SmolVLM (`lowmem_ft.vision.idefics3`) against transformers: the tiling against the image processor at
several sizes and caps, the sample's ids against `Idefics3Processor`'s own expansion, labels on the answers only,
and the model's loss on a collated batch against a plain cross-entropy."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lowmem_ft.vision.data import VisionCollator, load_vision_data
from lowmem_ft.vision.families import VISION_FAMILIES
from lowmem_ft.vision.idefics3 import Idefics3Images
from tests.vision.conftest import ROWS

# (height, width): smaller than a tile, one tile exactly, wide, tall, odd sides, extreme aspect ratios, large
SIZES = [(48, 64), (56, 56), (20, 30), (480, 640), (1080, 1920), (700, 10), (10, 700), (57, 113), (3000, 4000),
         (225, 224), (223, 300)]  # fmt: skip


def _images(model: str) -> tuple[Idefics3Images, object]:
    from transformers import AutoTokenizer

    config = json.loads((Path(model) / "config.json").read_text())
    family = VISION_FAMILIES[config["model_type"]]
    images = family.images(json.loads((Path(model) / "preprocessor_config.json").read_text()), config)
    tokenizer = AutoTokenizer.from_pretrained(model)
    return replace(images, newline_pair=len(tokenizer("\n\n", add_special_tokens=False)["input_ids"])), tokenizer


@pytest.mark.parametrize("zoo", ["smolvlm", "smolvlm2"])
@pytest.mark.parametrize("max_pixels", [None, 112 * 112, 56 * 56, 150 * 150])
def test_tiles_are_the_image_processors(zoo, max_pixels, request):
    """rows × cols and the tile count the PIL image processor makes (Idefics3ImageProcessorPil,
    SmolVLMImageProcessorPil) at the shipped longest edge (4 tiles a side) and at capped ones; the image tokens
    = image_seq_len per tile and the processor's own count (`_get_num_multimodal_tokens`)."""
    import numpy as np
    from transformers import AutoImageProcessor

    model = request.getfixturevalue(zoo)
    processor = AutoImageProcessor.from_pretrained(model)
    assert type(processor).__name__.endswith("ImageProcessorPil")
    images, tokenizer = _images(model)
    assert (images.tile, images.longest_edge, images.seq_len) == (56, 224, 4)
    assert json.loads((Path(model) / "processor_config.json").read_text())["image_seq_len"] == images.seq_len
    cap = max_pixels or images.max_pixels
    for h, w in SIZES:
        out = processor(images=[[np.zeros((h, w, 3), dtype=np.uint8)]], return_tensors="np",
                        **images.processor_kwargs(cap))  # fmt: skip
        assert (out["rows"][0][0], out["cols"][0][0]) == images.grid(h, w, cap), (h, w)
        assert out["pixel_values"].shape[1] == images.tiles(h, w, cap), (h, w)
        text = images.expansion(h, w, cap)
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == images.positions(h, w, cap), (h, w)
        assert text.count("<image>") == images.seq_len * images.tiles(h, w, cap) == images.tokens(h, w, cap)
    assert images.edge(cap) == {None: 224, 112 * 112: 112, 56 * 56: 56, 150 * 150: 112}[max_pixels]


def test_the_published_smolvlm_instruct_processor():
    """SmolVLM-Instruct's numbers (catalog): tile 384, longest edge 1536, 81 tokens a tile (729 patches / 3²); a
    640×480 photo is 4 × 3 tiles + the global one, 13 × 81 image tokens; even a tiny image is scaled up to the
    longest edge first (the processor resizes up as well as down)."""
    from lowmem_ft.memory.arch import catalog_entry

    _, entry = catalog_entry("HuggingFaceTB/SmolVLM-Instruct")
    images = VISION_FAMILIES["idefics3"].images(entry["preprocessor"], entry["config"])
    assert (images.tile, images.longest_edge, images.seq_len, images.patches_per_tile) == (384, 1536, 81, 729)
    assert images.grid(480, 640) == (3, 4) and images.tiles(480, 640) == 13
    assert images.expansion(480, 640).count("<image>") == 13 * 81 == images.tokens(480, 640) and images.grid(
        48, 64
    ) == (3, 4)
    assert images.caps(1536**2) == [1536**2, 1152**2, 768**2, 384**2] and images.max_tokens(384**2) == 81
    assert images.positions(384, 384, 384**2) == 84 and images.caps(1000**2) == [768**2, 384**2]


def test_ids_are_the_processors_and_labels_the_answers(smolvlm, tmp_path):
    """input_ids = what Idefics3Processor makes of the chat template's text and the images (the plain
    computation); labels = exactly the assistant answers' tokens with <end_of_utterance>; no image token a label."""
    from PIL import Image
    from transformers import AutoImageProcessor, Idefics3Processor

    from tests.vision.conftest import write_rows

    data = write_rows(tmp_path, ROWS)
    images, tokenizer = _images(smolvlm)
    loaded = load_vision_data(data, tokenizer, images, max_pixels=images.max_pixels,
                              max_seq_len=4096)  # fmt: skip
    assert len(loaded.records) == len(ROWS)
    processor = Idefics3Processor(AutoImageProcessor.from_pretrained(smolvlm), tokenizer, image_seq_len=4)
    specials = {tokenizer.convert_tokens_to_ids(t) for t in ("<image>", "<fake_token_around_image>", "<global-img>")}
    for row, sample in zip(ROWS, loaded.records, strict=True):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        pictures = [Image.open(tmp_path / name).convert("RGB") for name in row["images"]]
        assert sample["input_ids"] == processor(text=[text], images=[pictures])["input_ids"][0]
        learned = [t for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != -100]
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        answers = ["".join(p["text"] for p in a) if isinstance(a, list) else a for a in answers]
        expected = "".join(f" {a}<end_of_utterance>" for a in answers)
        assert learned == tokenizer(expected, add_special_tokens=False)["input_ids"]
        labelled = {t for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != -100}
        image_id = tokenizer.convert_tokens_to_ids("<image>")
        assert not labelled & specials and sum(sample["image_tokens"]) == sample["input_ids"].count(image_id) > 40


@pytest.mark.parametrize("zoo", ["smolvlm", "smolvlm2"])
def test_the_models_loss_is_a_plain_cross_entropy_over_the_answers(zoo, tmp_path, request):
    """A batch of samples with one, two and no image through the model: its loss equals the mean cross-entropy of
    the next token at exactly the answers' positions, computed by hand from its logits."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from tests.vision.conftest import write_rows

    model_dir = request.getfixturevalue(zoo)
    text_only = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
    data = write_rows(tmp_path, [*ROWS, text_only])
    images, tokenizer = _images(model_dir)
    loaded = load_vision_data(data, tokenizer, images, max_pixels=images.max_pixels, max_seq_len=4096)
    collate = VisionCollator(AutoImageProcessor.from_pretrained(model_dir), tokenizer.pad_token_id, images,
                             images.max_pixels)  # fmt: skip
    batch = collate(loaded.records)
    tiles = [sum(images.tiles(h, w) for h, w in r["sizes"]) for r in loaded.records]
    assert batch["pixel_values"].shape[:2] == (len(loaded.records), max(tiles))
    assert collate.pixels_held() == sum(t.numel() * t.element_size() for k, t in batch.items() if k.startswith("pix"))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(**batch)
    logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    picked = labels != -100
    plain = torch.nn.functional.cross_entropy(logits[picked], labels[picked])
    torch.testing.assert_close(out.loss, plain)
