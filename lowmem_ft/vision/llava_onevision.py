"""LLaVA-OneVision's images as numbers: anyres tiling (a grid of crops chosen from `image_grid_pinpoints` plus the
whole image as a base crop), the grid's features unpadded back to the image's aspect ratio, pooled down past
`anyres_max_N` crops, and a newline feature closing each row: the `ImageArithmetic` of `lowmem_ft.vision.families`.
Pure arithmetic but `process` (the collator's call into transformers).

The rule, read in transformers 5.24:

- the image processor (image_processing_pil_llava_onevision.py) picks the grid with `select_best_resolution`
  (image_processing_utils.py: the pinpoint keeping the most of the image's pixels, then wasting the fewest), resizes
  and pads the image to it, cuts it into crop-sized patches and adds the whole image resized to one crop — but only
  for a sample with one image: in a sample of several, every image is its base crop alone (`need_patching`);
- `LlavaOnevisionProcessor._get_number_of_features` (processing_llava_onevision.py) counts the tokens as the model's
  `pack_image_features` lays them out: (side·rows) × (side·cols) grid features with the padding rows or columns
  removed (`_get_unpadded_features`), scaled down by `ratio` when that grid holds more than 1.1² × N crops' worth,
  one newline feature per remaining row, then the base crop's side² features; an image of a multi-image sample is
  side² + 1 (`replace_image_token`). "default" feature selection takes one off.

There is no resolution knob here: the pinpoints fix the grids, and `vision.max_pixels` does not change them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lowmem_ft.vision.fixed import FixedResolution


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """`select_best_resolution` (image_processing_utils.py): the (height, width) pinpoint the image is fitted to."""
    best, most, least = pinpoints[0], 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least):
            best, most, least = (h, w), effective, wasted
    return best


@dataclass(frozen=True)
class AnyresImages(FixedResolution):
    """LLaVA-OneVision's image processor and the model's feature layout, as numbers."""

    crop: int = 384  # the processor's size.height = the tower's image_size
    pinpoints: tuple[tuple[int, int], ...] = ((384, 384),)  # image_grid_pinpoints (config.json's: the model's own)
    side: int = 27  # features per crop side: image_size // patch_size
    max_crops: int = 9  # vision_aspect_ratio "anyres_max_9"
    drop_one: bool = False  # vision_feature_select_strategy "default"
    channels: int = 3
    placeholder: str = "<image>"  # what the chat template renders once per image
    image_token: str = "<image>"  # repeated once per feature by the processor

    @classmethod
    def from_preprocessor(cls, preprocessor: dict[str, Any], config: dict[str, Any] | None = None) -> AnyresImages:
        config = config or {}
        size = preprocessor.get("size") or {}
        vision = config.get("vision_config") or {}
        pinpoints = config.get("image_grid_pinpoints") or preprocessor.get("image_grid_pinpoints") or []
        return cls(
            crop=int(size.get("height") or size.get("shortest_edge") or 384),
            pinpoints=tuple((int(h), int(w)) for h, w in pinpoints) or ((384, 384),),
            side=int(vision.get("image_size", 384)) // int(vision.get("patch_size", 14)),
            max_crops=int(str(config.get("vision_aspect_ratio", "anyres_max_9")).removeprefix("anyres_max_")),
            drop_one=config.get("vision_feature_select_strategy", "full") == "default",
        )

    # -- the knob: none --------------------------------------------------------------------------------------------
    @property
    def max_pixels(self) -> int:
        return max(h * w for h, w in self.pinpoints)

    def _how(self) -> str:
        return f"vision.max_pixels {self.max_pixels} ({self.describe()}); vision.max_pixels does not apply"

    def describe(self, max_pixels: int | None = None) -> str:
        rows, cols = max(self.pinpoints, key=lambda p: p[0] * p[1])
        grid = f"{rows // self.crop}×{cols // self.crop}"
        most = self.max_tokens()
        return f"fixed by image_grid_pinpoints: up to {grid} crops of {self.crop} px + the base, ≤ {most} tokens"

    # -- one image ------------------------------------------------------------------------------------------------
    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of crops a sample's only image is cut into."""
        h, w = best_resolution(height, width, self.pinpoints)
        return h // self.crop, w // self.crop

    def crops(self, height: int, width: int, images_in_sample: int = 1) -> int:
        """Crops the tower sees for this image: the grid and the base, or the base alone in a multi-image sample."""
        rows, cols = self.grid(height, width)
        return rows * cols + 1 if images_in_sample == 1 else 1

    def tokens(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> int:
        if images_in_sample != 1:
            return self.side**2 + 1 - self.drop_one
        rows, cols = self.grid(height, width)
        current_h, current_w = self.side * rows, self.side * cols
        if width / height > current_w / current_h:  # _get_unpadded_features: the padding rows / columns go
            new_h = int(round(height * (current_w / width), 7))
            current_h -= (current_h - new_h) // 2 * 2
        else:
            new_w = int(round(width * (current_h / height), 7))
            current_w -= (current_w - new_w) // 2 * 2
        unpadded, newlines = current_h * current_w, current_h
        ratio = math.sqrt(current_h * current_w / (self.max_crops * self.side**2))
        if ratio > 1.1:
            unpadded, newlines = int(current_h // ratio) * int(current_w // ratio), int(current_h // ratio)
        return unpadded + newlines + self.side**2 - self.drop_one

    def max_tokens(self, max_pixels: int | None = None) -> int:
        return max(self.tokens(h, w) for h, w in self.pinpoints)

    def patches(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> int:
        return self.crops(height, width, images_in_sample) * self.side**2

    @property
    def patches_per_token(self) -> int:
        """One feature per patch before packing; a sample's patches are `sample_patches` (its crops), since
        unpadding, newlines and anyres_max pooling make the tokens no fixed multiple of them."""
        return 1

    def sample_patches(self, sizes: list[tuple[int, int]]) -> int:
        """The tower's patches for one sample's images ((height, width) each): every crop it runs."""
        return sum(self.patches(h, w, images_in_sample=len(sizes)) for h, w in sizes)

    def expansion(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> str:
        return "<image>" * self.tokens(height, width, max_pixels, images_in_sample)

    # -- the processor ---------------------------------------------------------------------------------------------
    def process(self, processor, images: list[list], cap: int) -> tuple[dict[str, Any], list[int]]:
        """(pixel_values (samples, most crops, 3, crop, crop), image_sizes and batch_num_images, as the model takes
        them; the tokens of each image, in order), checked against the crops this arithmetic gives each image."""
        del cap
        kept = [sample for sample in images if sample]
        out = processor(images=kept, return_tensors="pt")
        sizes = [[(image.height, image.width) for image in sample] for sample in kept]
        expected = max(self.crops(h, w, len(sample)) for sample in sizes for h, w in sample)
        made = [tuple(s) for s in out["image_sizes"].tolist()]
        if made != [s for sample in sizes for s in sample] or out["pixel_values"].shape[1] != expected:
            raise RuntimeError(f"image processor made {tuple(out['pixel_values'].shape)} for images {made}")
        tokens = [self.tokens(h, w, images_in_sample=len(sample)) for sample in sizes for h, w in sample]
        inputs = {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"],
                  "batch_num_images": out["batch_num_images"]}  # fmt: skip
        return inputs, tokens

    def image_units(self, inputs: dict[str, Any]) -> tuple[list[int], dict[str, list[int]]]:
        """(image tokens of each image in the batch, in order; for each per-unit input, its first-dimension
        entries per unit): what `VisionCollator.split` cuts a micro batch by."""
        sizes, tokens = inputs["image_sizes"].tolist(), []
        for k in inputs["batch_num_images"].tolist():  # a sample's images, for each sample that has any
            tokens += [self.tokens(h, w, images_in_sample=k) for h, w in sizes[len(tokens) : len(tokens) + k]]
        return tokens, {"pixel_values": [1] * len(sizes), "image_sizes": [1] * len(sizes)}

    def text_inputs(self, input_ids, image_token_id: int) -> dict[str, Any]:
        del input_ids, image_token_id
        return {}
