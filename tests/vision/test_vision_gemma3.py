"""Gemma-3 on images (lowmem_ft.vision.gemma3): the tokens per image and pan-and-scan crops against
Gemma3ImageProcessorPil, the expanded ids against Gemma3Processor itself, the labels on the answers only, and the
model's loss from the collated batch (token_type_ids included) against a plain masked cross-entropy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lowmem_ft.vision.data import VisionCollator, load_vision_data
from lowmem_ft.vision.families import VISION_FAMILIES
from lowmem_ft.vision.gemma3 import Gemma3Images
from tests.vision.conftest import ROWS, write_rows

# (height, width): square, landscape and portrait, under and over the 1.2 aspect ratio and the 256-pixel crops
SIZES = [(48, 64), (480, 640), (300, 900), (900, 300), (256, 1300), (1080, 1920), (200, 1000), (600, 2600)]


def _arithmetic(model: str, **preprocessor) -> Gemma3Images:
    config = json.loads((Path(model) / "config.json").read_text())
    pre = json.loads((Path(model) / "preprocessor_config.json").read_text()) | preprocessor
    return VISION_FAMILIES["gemma3"].images(pre, config)


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_crops_and_tokens_are_the_processors(gemma3_vl, pan_and_scan):
    import numpy as np
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(gemma3_vl)
    assert type(processor).__name__ == "Gemma3ImageProcessorPil"
    images = _arithmetic(gemma3_vl, do_pan_and_scan=pan_and_scan)
    assert images.tokens_per_crop == 4 and images.image_size == 28
    crops = []
    for h, w in SIZES:
        inputs, made = images.process(processor, [[np.zeros((h, w, 3), dtype=np.uint8)]], images.max_pixels)
        crops.append(images.crops(h, w))
        assert inputs["pixel_values"].shape == (1 + crops[-1], 3, 28, 28), (h, w)
        assert made == [images.tokens(h, w)] == [4 * (1 + crops[-1])], (h, w)
    assert any(crops) == pan_and_scan  # the sizes do make crops when it is on
    hub = Gemma3Images.from_preprocessor({"size": {"height": 896, "width": 896}}, {"mm_tokens_per_image": 256})
    assert hub.tokens(480, 640) == hub.max_tokens() == 256 and hub.max_pixels == 896 * 896


def _named_tokenizer(model: str, tmp_path: Path):
    """The zoo tokenizer with Gemma-3's named image tokens (tokenizer_config.json `extra_special_tokens` as the Hub
    writes them), which Gemma3Processor reads."""
    from transformers import AutoTokenizer

    copy = tmp_path / "tok"
    copy.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(model) / name, copy / name)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                      "image_token": "<image_soft_token>"}  # fmt: skip
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(copy)


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_ids_are_gemma3_processors_and_labels_the_answers(gemma3_vl, tmp_path, pan_and_scan):
    """input_ids = Gemma3Processor(text=the rendered chat, images=...) — newlines, <start_of_image>, the soft tokens,
    <end_of_image>, the pan-and-scan crops' text; labels = the answers' tokens (with <end_of_turn>), image tokens
    never; token_type_ids = the processor's."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

    rows = [*ROWS, {**ROWS[0], "images": ["img/wide.png"]}]
    path = write_rows(tmp_path, rows)
    Image.new("RGB", (900, 300), (9, 9, 9)).save(tmp_path / "img" / "wide.png")  # 3 crops when pan-and-scan is on
    images = _arithmetic(gemma3_vl, do_pan_and_scan=pan_and_scan)
    tokenizer = AutoTokenizer.from_pretrained(gemma3_vl)
    data = load_vision_data(path, tokenizer, images, max_pixels=images.max_pixels, max_seq_len=4096)
    image_processor = AutoImageProcessor.from_pretrained(gemma3_vl)
    processor = Gemma3Processor(image_processor, _named_tokenizer(gemma3_vl, tmp_path), image_seq_length=4)
    soft = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert len(data.records) == len(rows)
    for row, sample in zip(rows, data.records, strict=True):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        pictures = [Image.open(path.parent / name).convert("RGB") for name in row["images"]]
        expected = processor(text=[text], images=[pictures], add_special_tokens=False, do_pan_and_scan=pan_and_scan,
                             return_tensors="np")  # fmt: skip
        assert sample["input_ids"] == expected["input_ids"][0].tolist()
        learned = [t for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != -100]
        answers = "".join(
            (m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]) + "<end_of_turn>"
            for m in row["messages"]
            if m["role"] == "assistant"
        )
        assert learned == tokenizer(answers, add_special_tokens=False)["input_ids"]
        assert sample["input_ids"].count(soft) == sum(sample["image_tokens"]) > 0
        batch = VisionCollator(image_processor, tokenizer.pad_token_id, images, images.max_pixels,
                               image_token_id=soft)([sample])  # fmt: skip
        assert batch["token_type_ids"][0].tolist() == expected["token_type_ids"][0].tolist()
    wide = data.records[-1]["image_tokens"]
    assert wide == ([4 * (1 + 3)] if pan_and_scan else [4])


def test_the_models_loss_is_a_plain_cross_entropy_over_the_answers(gemma3_vl, vlm_data):
    """The collated batch (pixel values, token_type_ids) through Gemma3ForConditionalGeneration: its loss equals the
    mean cross-entropy of the next token at exactly the answers' positions, computed by hand from its logits; the
    image tokens attend to each other both ways (token_type_ids change the logits)."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3_vl)
    images = _arithmetic(gemma3_vl)
    data = load_vision_data(vlm_data, tokenizer, images, max_pixels=images.max_pixels, max_seq_len=1024)
    soft = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    batch = VisionCollator(AutoImageProcessor.from_pretrained(gemma3_vl), tokenizer.pad_token_id, images,
                           images.max_pixels, image_token_id=soft)(data.records)  # fmt: skip
    assert batch["pixel_values"].shape == (4, 3, 28, 28) and batch["pixel_values"].dtype == torch.float32
    model = AutoModelForImageTextToText.from_pretrained(gemma3_vl, dtype=torch.float32).eval()
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight)  # zeros as initialized
    with torch.no_grad():
        out = model(**batch)
        causal = model(**{k: v for k, v in batch.items() if k != "token_type_ids"})
    logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    picked = labels != -100
    plain = torch.nn.functional.cross_entropy(logits[picked], labels[picked])
    torch.testing.assert_close(out.loss, plain)
    assert not torch.allclose(out.logits, causal.logits)  # the image blocks are bidirectional


@pytest.mark.slow
def test_train_gemma3_on_images_fits_its_prediction(gemma3_vl, tmp_path, capsys):
    """`train --vram 8` on image chats: the loss falls, the adapter is on the language model only, every training
    phase's exact live bytes are within 8 % of the memory model, `generate --image` runs and encodes its prompt as
    Gemma3Processor does, and `plan` names the image tokens per sample."""
    from lowmem_ft.cli import main
    from tests.vision.test_vision_train import _argv

    data = write_rows(tmp_path, ROWS, repeat=4)
    assert main(_argv(gemma3_vl, data, tmp_path / "runs", "g3")) == 0
    run = tmp_path / "runs" / "g3"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and metrics["last_loss"] < metrics["first_loss"]
    vision = json.loads((run / "run.json").read_text())["data"]["vision"]
    assert vision["image_tokens_per_sample"] == {"p50": 4, "p99": 8, "max": 8}  # 4 per image, one or two images

    from safetensors import safe_open

    with safe_open(run / "adapter" / "adapter_model.safetensors", "pt") as saved:
        keys = list(saved.keys())
    assert keys and all("language_model" in k for k in keys), [k for k in keys if "language_model" not in k][:3]
    assert json.loads((run / "adapter" / "preprocessor_config.json").read_text())["size"] == {"height": 28, "width": 28}

    samples = [json.loads(line) for line in (run / "memory.jsonl").read_text().splitlines()]
    phases = [s for s in samples if s.get("phase") in ("forward", "backward", "optimizer")]
    assert {s["phase"] for s in phases} == {"forward", "backward", "optimizer"}
    for s in phases:
        assert abs(s["peak_live_gb"] / s["predicted_peak_live_gb"] - 1) <= 0.08, s
    assert max(s["batch"][1] for s in phases if "batch" in s) > 60  # text + image tokens ran

    capsys.readouterr()
    image = str(tmp_path / "img" / "green.jpg")
    argv = ["generate", str(run), "--prompt", "What colour is it?", "--image", image, "--max-new-tokens", "6"]
    assert main([*argv, "--temperature", "0"]) == 0
    _generate_encodes_as_gemma3_processor(run, gemma3_vl, image, tmp_path)

    assert main(["plan", "--vram", "8", "--model", gemma3_vl, "--data", str(data), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["vision"]["max_tokens_per_image"] == 4 and "Gemma-3 resizes every image" in plan["vision"]["why"]
    assert plan["vision"]["data"]["image_tokens_per_sample"] == {"p50": 4, "p99": 8, "max": 8}


def _generate_encodes_as_gemma3_processor(run: Path, base: str, image: str, tmp_path: Path) -> None:
    """`generate --image`'s prompt (`ImagePrompt.encode`, with the run's saved processor) is Gemma3Processor's
    encoding of the same chat: input_ids, token_type_ids and pixel values."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

    from lowmem_ft.vision.generate import ImagePrompt

    tok = AutoTokenizer.from_pretrained(run / "adapter")
    saved = json.loads((run / "adapter" / "preprocessor_config.json").read_text())
    config = json.loads((Path(base) / "config.json").read_text())
    family = VISION_FAMILIES["gemma3"]
    image_processor = AutoImageProcessor.from_pretrained(run / "adapter")
    prompt = ImagePrompt(tok, family, family.images(saved, config), image_processor, [image])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    ours = prompt.encode(messages)
    processor = Gemma3Processor(image_processor, _named_tokenizer(base, tmp_path), image_seq_length=4)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    theirs = processor(text=[text], images=[[Image.open(image).convert("RGB")]], add_special_tokens=False,
                       return_tensors="pt")  # fmt: skip
    for key in ("input_ids", "token_type_ids", "pixel_values"):
        torch.testing.assert_close(ours[key], theirs[key])
