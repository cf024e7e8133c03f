"""`lowmem-ft train --vram 8` on the tiny Qwen2.5-VL checkpoint with image chats, as a user runs it, on the CPU: it
trains (loss falls), the adapter is on the language model only, the exact live bytes agree with the memory model
within 8 %, `plan` names the resolution cap and the image tokens per sample, and a truncated image is one line, exit
code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.cli import main
from tests.vision.conftest import ROWS, write_rows

MEMORY_TOLERANCE = 0.08


def _argv(model: str, data: Path, out: Path, name: str) -> list[str]:
    argv = ["train", "--vram", "8", "--model", model, "--data", str(data), "--name", name, "--no-wandb"]
    for kv in ("training.max_steps=6", "training.logging_steps=1", "memory.gradient_accumulation=1",
               "optimizer.lr=0.03", "optimizer.warmup_ratio=0", f"training.output_dir={out}"):  # fmt: skip
        argv += ["--set", kv]
    return argv


@pytest.mark.slow
def test_train_on_images_fits_its_prediction(qwen_vl, tmp_path, capsys):
    data = write_rows(tmp_path, ROWS, repeat=4)
    assert main(_argv(qwen_vl, data, tmp_path / "runs", "vlm")) == 0
    run = tmp_path / "runs" / "vlm"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and metrics["last_loss"] < metrics["first_loss"]
    info = json.loads((run / "run.json").read_text())
    vision = info["data"]["vision"]
    assert vision["max_pixels"] == 1280 * 28 * 28 and vision["image_tokens_per_sample"]["max"] == 12

    from safetensors import safe_open

    with safe_open(run / "adapter" / "adapter_model.safetensors", "pt") as saved:
        keys = list(saved.keys())
    assert keys and all("language_model" in k for k in keys), [k for k in keys if "language_model" not in k][:3]
    saved = json.loads((run / "adapter" / "preprocessor_config.json").read_text())
    assert saved["max_pixels"] == 1280 * 28 * 28 and saved["patch_size"] == 14  # the processor at the trained cap

    samples = [json.loads(line) for line in (run / "memory.jsonl").read_text().splitlines()]
    trained = [s for s in samples if s.get("phase") in ("forward", "backward") and s.get("predicted_peak_live_gb")]
    assert trained
    peak = max(trained, key=lambda s: s["peak_live_gb"])
    assert abs(peak["peak_live_gb"] / peak["predicted_peak_live_gb"] - 1) <= MEMORY_TOLERANCE, peak
    assert max(s["batch"][1] for s in trained) > 60  # sequences of text + image tokens ran

    # generate --image: the streamed greedy answer is base + adapter's on the same image, encoded by hand
    capsys.readouterr()
    image = str(tmp_path / "img" / "red.png")
    argv = ["generate", str(run), "--prompt", "What colour is it?", "--image", image, "--max-new-tokens", "6"]
    assert main([*argv, "--temperature", "0"]) == 0
    streamed = capsys.readouterr().out
    assert streamed.strip() == _by_hand(run, qwen_vl, image, "What colour is it?").strip()

    # merge: a model transformers loads as the image model, its processor beside it at the trained cap
    assert main(["merge", str(run), "--output", str(tmp_path / "merged")]) == 0
    assert json.loads((tmp_path / "merged" / "preprocessor_config.json").read_text())["max_pixels"] == 1280 * 784
    from transformers import AutoModelForImageTextToText

    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())

    capsys.readouterr()
    assert main(["plan", "--vram", "8", "--model", qwen_vl, "--data", str(data), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["vision"]["max_tokens_per_image"] == 1280
    assert plan["vision"]["data"]["image_tokens_per_sample"] == {"p50": 8, "p99": 12, "max": 12}


def _by_hand(run: Path, base: str, image: str, prompt: str) -> str:
    import numpy as np
    import torch
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from lowmem_ft.rundir import RunDir

    recipe = RunDir(run).read_recipe()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[recipe.model.compute_dtype]
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=dtype, attn_implementation="sdpa")
    model = PeftModel.from_pretrained(model, str(run / "adapter")).eval()
    tok = AutoTokenizer.from_pretrained(run / "adapter")
    processor = AutoImageProcessor.from_pretrained(run / "adapter")
    pixels = processor(images=[np.asarray(Image.open(image).convert("RGB"))], return_tensors="pt")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(pixels["image_grid_thw"][0].prod()) // 4))
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, **pixels, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_a_truncated_image_is_one_line_exit_2(qwen_vl, tmp_path, capsys):
    data = write_rows(tmp_path, ROWS)
    whole = (tmp_path / "img" / "green.jpg").read_bytes()
    (tmp_path / "img" / "green.jpg").write_bytes(whole[: len(whole) // 3])
    assert main(_argv(qwen_vl, data, tmp_path / "runs", "bad")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vlm.jsonl:2: image 'img/green.jpg' is truncated or undecodable" in err[0], err


def test_the_planner_steps_the_cap_down_until_every_sample_fits_whole(qwen_vl, tmp_path, capsys):
    """A 1000×1000 image with memory.max_seq_len 300 fixed: at 256 tokens per image (448×448) the sample needs 303
    tokens, so the plan trains at 128 per image (the largest of CAP_TOKENS that keeps it whole) and says so."""
    from PIL import Image

    (tmp_path / "img").mkdir()
    Image.new("RGB", (1000, 1000), (1, 2, 3)).save(tmp_path / "img" / "big.png")
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
                        {"role": "assistant", "content": "A dark square."}], "images": ["img/big.png"]}  # fmt: skip
    data = tmp_path / "big.jsonl"
    data.write_text((json.dumps(row) + "\n") * 4)
    argv = ["plan", "--vram", "8", "--model", qwen_vl, "--data", str(data), "--set", "memory.max_seq_len=300"]
    assert main([*argv, "--json"]) == 0
    vision = json.loads(capsys.readouterr().out)["vision"]
    assert vision["max_pixels"] == 128 * 28 * 28 and vision["data"]["tokens_per_sample"]["max"] <= 300
    assert "the largest at which every sample fits whole in the plan's 300 tokens (at 200704" in vision["why"]


def test_plan_of_the_hub_checkpoint_offline_names_the_cap(capsys):
    assert main(["plan", "--vram", "24", "--model", "Qwen/Qwen2.5-VL-7B-Instruct"]) == 0
    out = capsys.readouterr().out
    assert "vision tower" in out or "vision.max_pixels 1003520 (≤ 1280 tokens per image)" in out
    assert "12845056 would let one image become 16384 tokens" in out


def test_data_stats_reports_images_and_their_tokens(qwen_vl, vlm_data, capsys):
    assert main(["data", "stats", str(vlm_data), "--model", qwen_vl, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    d = stats["data"]
    assert d["samples"] == 3 and d["images_per_sample"] == {"p50": 1, "max": 2}
    # red 64×48 → 2×2 tokens, green 100×60 → 2×4: per sample 4 (red), 12 (red + green), 8 (green)
    assert d["image_tokens_per_sample"] == {"p50": 8, "p99": 12, "max": 12}
    assert d["pixels_per_image"]["max"] == 100 * 60 and stats["max_tokens_per_image"] == 1280
