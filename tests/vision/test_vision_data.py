"""Image chats: ids and labels against the plain computation (transformers' own chat rendering, the processor's
grid), the loss the model computes from the collated batch against a plain cross-entropy, and every bad image as
one line naming the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.vision.data import VisionCollator, load_vision_data
from lowmem_ft.vision.qwen_vl import QwenVLImages
from tests.vision.conftest import ROWS, write_rows


def _load(model: str, path: Path, **kwargs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    images = QwenVLImages.from_preprocessor(json.loads((Path(model) / "preprocessor_config.json").read_text()))
    args = {"max_pixels": images.max_pixels, "max_seq_len": 1024} | kwargs
    return tokenizer, images, load_vision_data(path, tokenizer, images, **args)


def _answers(messages: list[dict]) -> list[str]:
    out = []
    for m in messages:
        if m["role"] == "assistant":
            c = m["content"]
            out.append((c if isinstance(c, str) else "".join(p["text"] for p in c)) + "<|im_end|>")
    return out


def test_ids_and_labels_are_the_plain_computation(qwen_vl, vlm_data):
    """input_ids = the template rendered by transformers with each <|image_pad|> repeated grid_t·h·w / 4 times (the
    image processor's grid); labels = exactly the assistant answers' tokens (with <|im_end|>), image tokens never."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    tokenizer, _, data = _load(qwen_vl, vlm_data)
    processor = AutoImageProcessor.from_pretrained(qwen_vl)
    assert len(data.records) == len(ROWS)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row, sample in zip(ROWS, data.records, strict=True):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        for name in row["images"]:
            grid = processor(images=[np.asarray(Image.open(vlm_data.parent / name).convert("RGB"))])["image_grid_thw"]
            text = text.replace("<|image_pad|>", "<|IMG|>" * (int(np.prod(grid[0])) // 4), 1)
        expected = tokenizer(text.replace("<|IMG|>", "<|image_pad|>"), add_special_tokens=False)["input_ids"]
        assert sample["input_ids"] == expected
        learned = [t for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != -100]
        assert learned == tokenizer("".join(_answers(row["messages"])), add_special_tokens=False)["input_ids"]
        assert all(label == -100 for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if t == pad)
        assert sample["input_ids"].count(pad) == sum(sample["image_tokens"]) > 0


def test_the_models_loss_is_a_plain_cross_entropy_over_the_answers(qwen_vl, vlm_data):
    """The collated batch through Qwen2_5_VLForConditionalGeneration: its loss equals the mean cross-entropy of the
    next token at exactly the answers' positions, computed by hand from its logits."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    tokenizer, images, data = _load(qwen_vl, vlm_data)
    batch = VisionCollator(AutoImageProcessor.from_pretrained(qwen_vl), tokenizer.pad_token_id, images,
                           images.max_pixels)(data.records)  # fmt: skip
    assert batch["pixel_values"].shape[0] == 4 * sum(sum(r["image_tokens"]) for r in data.records)
    model = AutoModelForImageTextToText.from_pretrained(qwen_vl, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(**batch)
    logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    picked = labels != -100
    plain = torch.nn.functional.cross_entropy(logits[picked], labels[picked])
    torch.testing.assert_close(out.loss, plain)


BAD = {
    "missing": ({"images": ["img/nowhere.png"]}, r"vlm.jsonl:2: image 'img/nowhere.png' not found"),
    "not an image": ({"images": ["notes.png"]}, r"vlm.jsonl:2: image 'notes.png' is not an image PIL can read"),
    "truncated": ({"images": ["cut.png"]}, r"vlm.jsonl:2: image 'cut.png' is truncated or undecodable"),
    "count": ({"images": ["img/red.png", "img/red.png"]}, r"vlm.jsonl:2: has 1 image placeholder\(s\) .* but 2 image"),
    "url": ({"images": ["https://example.com/a.png"]}, r"vlm.jsonl:2: image 'https://example.com/a.png' is a URL"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_image_is_one_line_naming_the_row(qwen_vl, tmp_path, case):
    change, message = BAD[case]
    rows = [ROWS[0], {**ROWS[0], **change}]
    path = write_rows(tmp_path, rows)
    (tmp_path / "notes.png").write_text("not a picture\n")
    whole = (tmp_path / "img" / "red.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=message) as info:
        _load(qwen_vl, path)
    assert "\n" not in str(info.value)
    _, _, data = _load(qwen_vl, path, skip_bad_lines=True)  # or skipped and counted
    assert len(data.records) == 1 and sum(data.skipped.values()) == 1


def test_a_sample_longer_than_max_seq_len_is_dropped_never_cut(qwen_vl, vlm_data):
    _, _, whole = _load(qwen_vl, vlm_data)
    longest = max(len(r["input_ids"]) for r in whole.records)
    _, _, data = _load(qwen_vl, vlm_data, max_seq_len=longest - 1)
    assert data.too_long == 1 and len(data.records) == len(ROWS) - 1
    assert all(len(r["input_ids"]) < longest for r in data.records)


def test_llama_factory_image_placeholders_read_as_trl_image_parts(qwen_vl, tmp_path):
    """LLaMA-Factory's form (data/mllm_demo.json: `<image>` in the user's text) gives the ids and labels of the same
    conversation in TRL's form."""
    factory = {
        "messages": [
            {"role": "user", "content": "<image>What colour is it?"},
            {"role": "assistant", "content": "It is red."},
        ],
        "images": ["img/red.png"],
    }
    _, _, ours = _load(qwen_vl, write_rows(tmp_path, [factory], name="factory.jsonl"))
    _, _, trl = _load(qwen_vl, write_rows(tmp_path, [ROWS[0]], name="trl.jsonl"))
    assert ours.records[0]["input_ids"] == trl.records[0]["input_ids"]
    assert ours.records[0]["labels"] == trl.records[0]["labels"]
    wrong = {**factory, "images": []}
    with pytest.raises(UserError, match=r"wrong.jsonl:1: has 1 image placeholder"):
        _load(qwen_vl, write_rows(tmp_path, [wrong], name="wrong.jsonl"))
