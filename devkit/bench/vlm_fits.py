"""What the planner chooses for Qwen2.5-VL-3B / 7B-Instruct at 8 / 24 / 40 GB, by images per sample and resolution cap
— predicted by the memory model, not measured on a GPU.

    python -m devkit.bench.vlm_fits [--out benchmarks/vlm_fits.md]

Pure arithmetic (the planner, `lowmem_ft.choosing.choose_recipe`, on the offline catalog's config; no GPU, no
weights): each sample is 256 text tokens plus its images at the cap's most tokens per image (an image as large as
the cap allows: `lowmem_ft.vision.qwen_vl.QwenVLImages.max_tokens`), so memory.max_seq_len = 256 + images × tokens.
Caps: 256 tokens per image (200,704 pixels), 1,280 (1,003,520: the planner's default, Qwen's model card's) and 16,384
(12,845,056: the checkpoint's own preprocessor_config.json). Each cell is the planner's choice: weights, micro batch,
the savers it turned on, the predicted peak with CUDA overheads. The plan counts the vision tower's weights (668.7 M
of 3.75 B parameters; 676.6 M of 8.29 B), the accumulation window's pixel values (fp32, 1,176 per patch), the
frozen tower's forward (46,530 B per patch) and its outputs (`lowmem_ft.memory.tower`); the tower is frozen.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from lowmem_ft.choosing import choose_recipe
from lowmem_ft.errors import UserError
from lowmem_ft.train.observe.banner import savers_on
from lowmem_ft.vision.qwen_vl import QwenVLImages

MODELS = ("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct")
TEXT = 256
CAPS = (256 * 784, 1280 * 784, 12845056)
IMAGES = (1, 2, 4)
VRAM = (8, 24, 40)


def cell(model: str, vram: int, length: int, cap: int, patches: int) -> str:
    from lowmem_ft.data.profile import LengthProfile

    profile = replace(LengthProfile.from_lengths([length]), image_patches=patches)  # n images at the cap
    overrides = {"model": {"name_or_path": model}, "memory": {"max_seq_len": length}, "vision": {"max_pixels": cap}}
    try:
        recipe, choice = choose_recipe(vram_gb=vram, recipe=None, overrides=overrides, profile=profile)
    except UserError:
        return "does not fit"
    weights = "NF4" if recipe.model.quantization == "nf4" else recipe.model.quantization
    weights = "16-bit" if weights == "none" else weights
    savers = ", ".join(s for s in savers_on(recipe) if "paged" not in s) or "none"
    return f"{weights}, b {recipe.memory.micro_batch_size}, {savers}; {choice.predicted_peak_gb:.1f} GB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.vlm_fits", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    images = QwenVLImages(max_pixels=12845056)
    lines = []
    for model in MODELS:
        lines += [
            f"Predicted (memory model, not measured): {model}, {TEXT} text tokens per sample. Cell: the planner's "
            "weights, micro batch, savers (besides the paged optimizer), predicted peak.",
            "",
            "| images × cap (tokens per image) | sequence | " + " | ".join(f"{v} GB" for v in VRAM) + " |",
            "| --- | --- | " + " | ".join("---" for _ in VRAM) + " |",
        ]
        for n in IMAGES:
            for cap in CAPS:
                tokens = images.max_tokens(cap)
                length = TEXT + n * tokens
                patches = n * tokens * images.merge_size**2
                cells = " | ".join(cell(model, v, length, cap, patches) for v in VRAM)
                lines.append(f"| {n} × {cap:,} px ({tokens:,}) | {length:,} | {cells} |")
        lines.append("")
    text = "\n".join(lines).strip()
    print(text)
    if args.out:
        intro = (__doc__ or "").split("\n\n", 2)[2].strip()
        args.out.write_text(
            f"# Vision-language fine-tuning: what the planner chooses at 8 / 24 / 40 GB (predicted)\n\n"
            f"Command: `python -m devkit.bench.vlm_fits --out {args.out}`\n\n{intro}\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
