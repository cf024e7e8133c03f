"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL's image processor as numbers: how many tokens an image becomes at a resolution
cap, the text the placeholder expands to, and the processor call that makes the pixels. Pure arithmetic but
`process` (the collator's call into transformers).

The one idea: an image's token count is decided by the processor before the model sees it, so it is computed from
the image's pixel size with the processor's own rule, never measured. `image_processing_pil_qwen2_vl.py`
`smart_resize` (transformers 5.24): the image is resized to multiples of patch × merge (28 for Qwen2/2.5-VL, 32 for
Qwen3-VL's 16-pixel patches) with min_pixels ≤ h·w ≤ max_pixels keeping the aspect ratio, cut in patches, and every
merge × merge patches become one token (`Qwen2_5_VLProcessor.replace_image_token`: grid_t·grid_h·grid_w // merge²).
The chat template renders one `<|image_pad|>` per image; the processor repeats it once per token. Checked against
the processor on the zoo checkpoints (tests/vision/test_vision_families.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

# Caps the planner tries, in tokens per image (× factor² pixels: 784 on Qwen2.5-VL), largest first: the model card's
# 1280 and steps down to 64 (Qwen's min_pixels is 4 tokens; below 64 tokens a photo's detail is mostly gone).
CAP_TOKENS = (1280, 1024, 768, 512, 384, 256, 128, 64)
# The cap Qwen's model card recommends ("min_pixels = 256*28*28, max_pixels = 1280*28*28", Qwen2.5-VL-7B-Instruct
# README): 1280 tokens per image, where the shipped preprocessor_config.json allows 16,384.
DEFAULT_CAP_TOKENS = 1280


@dataclass(frozen=True)
class QwenVLImages:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL's image processor (preprocessor_config.json), as numbers."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280  # the class default; Qwen2.5-VL's preprocessor_config.json says 12,845,056
    channels: int = 3
    placeholder: str = "<|image_pad|>"  # what the chat template renders once per image
    image_token: str = "<|image_pad|>"  # what the image's features replace, repeated once per token
    # the model takes `mm_token_type_ids` (1 at image tokens) for its M-RoPE positions and refuses images without
    # them: Qwen2-VL and Qwen3-VL (modeling_qwen2_vl.py / modeling_qwen3_vl.py `get_rope_index`, transformers 5.24);
    # Qwen2.5-VL's forward has no such input
    token_types: bool = False

    @classmethod
    def from_preprocessor(cls, config: dict[str, Any], model_config: dict[str, Any] | None = None) -> QwenVLImages:
        """From a preprocessor_config.json dict (its `min_pixels` / `max_pixels`, or `size` in the newer form)."""
        size = config.get("size") or {}
        return cls(
            patch_size=int(config.get("patch_size", 14)),
            merge_size=int(config.get("merge_size", 2)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
            token_types=(model_config or {}).get("model_type") in ("qwen2_vl", "qwen3_vl"),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patches_per_token(self) -> int:
        """Rows of pixel_values (tower patches) behind one image token: merge² (`tokens`)."""
        return self.merge_size**2

    @property
    def patch_values(self) -> int:
        """Numbers in one row of pixel_values: channels × temporal patch × patch × patch (1176 at patch 14)."""
        return self.channels * self.temporal_patch_size * self.patch_size**2

    def resized(self, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int]:
        """`smart_resize` (image_processing_pil_qwen2_vl.py): the (height, width) the processor resizes to."""
        factor, low, high = self.factor, self.min_pixels, max_pixels or self.max_pixels
        if max(height, width) / min(height, width) > 200:
            raise ValueError(
                f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
            )
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > high:
            beta = math.sqrt((height * width) / high)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < low:
            beta = math.sqrt(low / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def patches(self, height: int, width: int, max_pixels: int | None = None) -> int:
        """Rows of pixel_values for one image: grid_h × grid_w patches (grid_t 1 for a still image)."""
        h, w = self.resized(height, width, max_pixels)
        return (h // self.patch_size) * (w // self.patch_size)

    def tokens(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> int:
        """Image tokens in the decoder's sequence for one image: patches // merge²."""
        del images_in_sample
        return self.patches(height, width, max_pixels) // self.merge_size**2

    def max_tokens(self, max_pixels: int | None = None) -> int:
        """The most tokens one image can become under `max_pixels` (any aspect ratio)."""
        return (max_pixels or self.max_pixels) // self.factor**2

    def expansion(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> str:
        """The text the processor puts where the template rendered the placeholder."""
        del images_in_sample
        return self.image_token * self.tokens(height, width, max_pixels)

    # -- the resolution cap (`vision.max_pixels`) -------------------------------------------------------------------
    def default_cap(self) -> tuple[int, str]:
        """(the cap without data, why): the model card's 1280 tokens, or the checkpoint's own when smaller."""
        cap = min(self.max_pixels, DEFAULT_CAP_TOKENS * self.factor**2)
        if cap < self.max_pixels:
            why = (
                f"vision.max_pixels {cap} (≤ {self.max_tokens(cap)} tokens per image): the checkpoint's "
                f"{self.max_pixels} would let one image become {self.max_tokens()} tokens"
            )
        else:
            why = f"vision.max_pixels {cap}: the checkpoint's own (≤ {self.max_tokens(cap)} tokens per image)"
        return cap, why

    def cap_why(self, cap: int) -> str:
        return f"vision.max_pixels {cap} (≤ {self.max_tokens(cap)} tokens per image)"

    def caps(self, ceiling: int) -> list[int]:
        """The caps the planner tries, largest first, none above `ceiling`."""
        area = self.factor**2
        return [t * area for t in CAP_TOKENS if t * area <= ceiling] or [ceiling]

    def with_cap(self, config: dict[str, Any], cap: int) -> dict[str, Any]:
        """A preprocessor_config.json dict that resizes to `cap`, for the weights a run saves."""
        config = {**config, "max_pixels": cap}
        if isinstance(config.get("size"), dict) and "longest_edge" in config["size"]:
            config["size"] = {**config["size"], "longest_edge": cap}
        return config

    def at_cap(self, cap: int) -> QwenVLImages:
        """The processor as a saved preprocessor_config.json at `cap` reads (`generate` of a run)."""
        return replace(self, max_pixels=cap)

    # -- the processor call (torch) ---------------------------------------------------------------------------------
    def process(self, processor, images: list[list], cap: int) -> tuple[dict[str, Any], list[int]]:
        """(the model's image inputs, tokens the processor made per image) for each sample's PIL images at `cap`:
        every image's patches concatenated, one image_grid_thw row each."""
        flat = [image for sample in images for image in sample]
        out = processor(images=flat, size={"shortest_edge": self.min_pixels, "longest_edge": cap},
                        return_tensors="pt")  # fmt: skip
        made = (out["image_grid_thw"].prod(-1) // self.merge_size**2).tolist()
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}, made

    def image_units(self, inputs: dict[str, Any]) -> tuple[list[int], dict[str, list[int]]]:
        """(image tokens of each image in the batch, in order; for each per-unit input, its first-dimension
        entries per unit): what `VisionCollator.split` cuts a micro batch by."""
        rows = inputs["image_grid_thw"].prod(-1).tolist()  # pixel_values rows: every image's patches, concatenated
        return [r // self.merge_size**2 for r in rows], {"pixel_values": rows, "image_grid_thw": [1] * len(rows)}

    def text_inputs(self, input_ids, image_token_id: int) -> dict[str, Any]:
        """Inputs the model needs beside input_ids that follow from them: Qwen2-VL's and Qwen3-VL's
        mm_token_type_ids (the processor's `create_mm_token_type_ids`: 1 at the image tokens)."""
        return {"mm_token_type_ids": (input_ids == image_token_id).int()} if self.token_types else {}
