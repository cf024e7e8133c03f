"""The image batches a traced vision-language step runs on: the plan's images, made as a run makes them.

The plan prices one sample's images at the resolution cap it chose (`Setup.image_patches`: the data's sample with
the most patches, `lowmem_ft.vision.setup.plan_patches`; without data one image as large as the cap allows). The
trace feeds exactly that sample, through the same path `train` feeds it: the data row tokenized by
`lowmem_ft.vision` (image placeholders expanded to the family's tokens, labels on the assistant's text only) and
collated by its `VisionCollator`, which opens the image files and runs the checkpoint's own image processor at the cap.
So `input_ids`, `pixel_values`, `image_grid_thw`, `token_type_ids` / `mm_token_type_ids` and `pixel_attention_mask`
are what a run's batch holds, real tensors (the tracer's `Shadow` keeps data real: Qwen-VL reads `image_grid_thw`
with `.tolist()` for its rotary positions and window indices).

The batch's rows are `micro_batch_size` copies of that sample, each filled to `memory.max_seq_len` with text tokens
that carry labels (the plan prices every row at the full length), the last one a quarter shorter when there are
several, so the collator pads it as it pads a shorter sample. Without `--data`, one synthetic image (a flat PNG in
a temporary folder) of the size that makes the most patches under the cap, in a one-turn chat.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import Recipe


@dataclass
class ImageSample:
    """One tokenized image chat (a `VisionData` record, its images as files) and the collator `train` uses."""

    record: dict[str, Any]  # input_ids, labels, image_files, image_tokens, sizes
    collator: Any
    filler: list[int]  # ordinary token ids the rows are filled with (no special, no image token)
    patches: int  # the tower's patches of this one sample, as the plan counts them
    source: str  # where the sample came from, for the user

    def batches(self, rows: int, seq: int, count: int, seed: int = 1) -> Iterator[dict[str, Any]]:
        """`count` micro batches of `rows` copies of the sample filled to `seq` tokens, each collated one ahead as
        the CPU loader collates it (`step.batches`)."""
        import torch

        own = len(self.record["input_ids"])
        if own > seq:
            raise UserError(
                f"--verify: the plan's image sample ({self.source}) is {own} tokens with its image tokens, more than "
                f"its memory.max_seq_len {seq}; pass --data FILE.jsonl (the plan then sizes the length from the "
                f"data's images) or --seq-len {own} or more"
            )
        gen = torch.Generator().manual_seed(seed)

        def row(length: int) -> dict[str, Any]:
            picks = torch.randint(0, len(self.filler), (max(0, length - own),), generator=gen).tolist()
            fill = [self.filler[i] for i in picks]
            r = self.record
            return {**r, "input_ids": r["input_ids"] + fill, "labels": r["labels"] + fill}

        def make() -> dict[str, Any]:
            lengths = [seq] * rows
            if rows > 1:
                lengths[-1] = max(own, seq - seq // 4)
            return self.collator([row(n) for n in lengths])

        ahead = [make()]
        for _ in range(count):
            ahead.append(make())
            yield ahead.pop(0)


def image_sample(recipe: Recipe) -> ImageSample | None:
    """The sample the plan priced for `recipe`, or None for a text model (and Gemma-3 on text data)."""
    from lowmem_ft.data.tokenize import load_tokenizer
    from lowmem_ft.vision.setup import vision_of

    vision = vision_of(recipe)
    if vision is None:
        return None
    m = recipe.model  # the tokenizer `plan` and `train` read the data with
    tokenizer = load_tokenizer(m.name_or_path, m.trust_remote_code, recipe.data.chat_template or None)
    unlimited = replace(recipe, memory=replace(recipe.memory, max_seq_len=0))
    if recipe.data.path:
        records = vision.load(unlimited, tokenizer).records
        source = f"the sample of {Path(recipe.data.path).name} with the most image patches"
    else:
        height, width = largest_image(vision.images, vision.max_pixels)
        folder = Path(tempfile.mkdtemp(prefix="lowmem-ft-trace-"))
        path = _synthetic_chat(folder, height, width)
        data = replace(recipe, data=replace(recipe.data, path=str(path)))
        records = vision.load(replace(data, memory=unlimited.memory), tokenizer).records
        source = f"one {width}×{height} image (no --data: the largest the cap keeps)"
    patches = [_patches(vision.images, r) for r in records]
    worst = records[max(range(len(records)), key=lambda i: (patches[i], len(records[i]["input_ids"])))]
    record = {"input_ids": worst["input_ids"], "labels": worst["labels"], "image_files": worst["images"],
              "image_tokens": worst["image_tokens"], "sizes": worst["sizes"]}  # fmt: skip
    specials = set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(list(_image_tokens(vision))))
    filler = [i for i in range(len(tokenizer)) if i not in specials]
    collator = _collator(vision, recipe, tokenizer)
    return ImageSample(record, collator, filler, max(patches), source)


def _patches(images, record: dict[str, Any]) -> int:
    """A sample's tower patches as the plan counts them (`VisionSetup.profile`)."""
    exact = getattr(images, "sample_patches", None)  # patches that are no multiple of tokens (OneVision)
    return exact(record["sizes"]) if exact else sum(record["image_tokens"]) * images.patches_per_token


def _image_tokens(vision) -> set[str]:
    return {vision.images.image_token, vision.images.placeholder}


def _collator(vision, recipe: Recipe, tokenizer):
    """`VisionSetup.collator`, with the image processor of a catalog model (a Hub id read offline) made from the
    catalog's preprocessor_config.json."""
    from lowmem_ft.memory.arch import catalog_entry

    if Path(recipe.model.name_or_path).is_dir():
        return vision.collator(recipe, tokenizer)
    folder = Path(tempfile.mkdtemp(prefix="lowmem-ft-processor-"))
    entry = catalog_entry(recipe.model.name_or_path)
    preprocessor = (entry[1].get("preprocessor") if entry else None) or {}
    if not preprocessor:
        raise UserError(f"--verify: no preprocessor_config.json known for {recipe.model.name_or_path}")
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor), "utf-8")
    return vision.collator(replace(recipe, model=replace(recipe.model, name_or_path=str(folder))), tokenizer)


def largest_image(images, cap: int) -> tuple[int, int]:
    """(height, width) of an image that makes the most tokens `images` allows under `cap`, as near square as the
    family's grid lets it be: for Qwen-VL a grid of max_tokens tokens (sides multiples of patch × merge); for the
    fixed-resolution families every size is resized alike, so the cap's square."""
    factor = getattr(images, "factor", None)
    if factor is None:
        side = max(1, math.isqrt(cap))
        return side, side
    tokens = images.max_tokens(cap)
    _, rows = max((a * (tokens // a), a) for a in range(1, math.isqrt(tokens) + 1))
    return rows * factor, tokens // rows * factor


def _synthetic_chat(folder: Path, height: int, width: int) -> Path:
    from PIL import Image

    Image.new("RGB", (width, height), (90, 120, 160)).save(folder / "image.png")
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]},
            {"role": "assistant", "content": "A flat blue picture."},
        ],
        "images": ["image.png"],
    }
    path = folder / "chat.jsonl"
    path.write_text(json.dumps(row) + "\n", "utf-8")
    return path
