"""`lowmem-ft train --vram 8` on the tiny SmolVLM checkpoint (Idefics3) with image chats, as a user runs it, on the
CPU: it trains (loss falls), the adapter is on the language model only, every phase's exact live bytes agree with
the memory model within 8 %, `generate --image` answers as the model does by hand, and `plan` names the tiling it
chose and the image tokens per sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.cli import main
from tests.vision.conftest import ROWS, adapter_keys, phases_within_prediction, write_rows
from tests.vision.test_vision_train import _argv


@pytest.mark.slow
def test_train_on_images_fits_its_prediction(smolvlm, tmp_path, capsys):
    data = write_rows(tmp_path, ROWS, repeat=4)
    assert main(_argv(smolvlm, data, tmp_path / "runs", "smol")) == 0
    run = tmp_path / "runs" / "smol"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and metrics["last_loss"] < metrics["first_loss"]
    vision = json.loads((run / "run.json").read_text())["data"]["vision"]
    # the shipped longest edge (4 tiles of 56 a side): red and green are both 3 × 4 tiles + the global image,
    # <image> tokens each: 13 tiles × image_seq_len 4 (the markers and newlines around them are not image tokens)
    assert vision["max_pixels"] == 224 * 224 and vision["image_tokens_per_sample"]["max"] == 2 * 13 * 4

    keys = adapter_keys(run)
    assert keys and all("text_model" in k for k in keys), [k for k in keys if "text_model" not in k][:3]
    saved = json.loads((run / "adapter" / "preprocessor_config.json").read_text())
    assert saved["size"] == {"longest_edge": 224} and saved["max_image_size"] == {"longest_edge": 56}
    assert json.loads((run / "adapter" / "processor_config.json").read_text())["image_seq_len"] == 4

    phases = phases_within_prediction(run)
    assert max(s["batch"][1] for s in phases["forward"]) > 200  # sequences of text + tiled image tokens ran

    capsys.readouterr()
    image = str(tmp_path / "img" / "green.jpg")
    argv = ["generate", str(run), "--prompt", "What colour is it?", "--image", image, "--max-new-tokens", "6"]
    assert main([*argv, "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip() == _by_hand(run, smolvlm, image, "What colour is it?").strip()

    # merge: the image model with both processor files beside it, which AutoProcessor loads (image_seq_len 4)
    assert main(["merge", str(run), "--output", str(tmp_path / "merged")]) == 0
    from transformers import AutoModelForImageTextToText, AutoProcessor

    assert AutoProcessor.from_pretrained(tmp_path / "merged").image_seq_len == 4
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())

    assert main(["plan", "--vram", "8", "--model", smolvlm, "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert "longest edge 224: ≤ 4×4 tiles of 56 px + a global image" in out
    assert "image tokens per sample p50 52, p99 104, max 104" in out


def _by_hand(run: Path, base: str, image: str, prompt: str) -> str:
    """Greedy answer of base + adapter on inputs made by transformers' own Idefics3Processor."""
    import torch
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, Idefics3Processor

    from lowmem_ft.rundir import RunDir

    recipe = RunDir(run).read_recipe()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[recipe.model.compute_dtype]
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=dtype, attn_implementation="sdpa")
    model = PeftModel.from_pretrained(model, str(run / "adapter")).eval()
    tok = AutoTokenizer.from_pretrained(run / "adapter")
    processor = Idefics3Processor(AutoImageProcessor.from_pretrained(run / "adapter"), tok, image_seq_len=4)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(image).convert("RGB")]], return_tensors="pt")
    inputs.pop("rows", None), inputs.pop("cols", None)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
