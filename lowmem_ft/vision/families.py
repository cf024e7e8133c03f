"""What lowmem-ft knows about each vision-language family: how many tokens an image becomes, and which special
tokens stand for it. One `VisionFamily` per transformers `model_type`; pure arithmetic (the memory model reads it).

The one idea: an image's token count is decided by the processor before the model sees it, so it is computed from
the image's pixel size with the processor's own rule, never measured. Qwen2-VL / Qwen2.5-VL
(`image_processing_pil_qwen2_vl.py` `smart_resize`, transformers 5.24): the image is resized to multiples of
patch × merge (28) with min_pixels ≤ h·w ≤ max_pixels keeping the aspect ratio, cut in 14×14 patches, and every
2×2 patches merge into one token (`Qwen2_5_VLProcessor.replace_image_token`: grid_t·grid_h·grid_w // merge²).
Checked against the processor on the zoo checkpoint (tests/vision/test_vision_families.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lowmem_ft.errors import UserError


@dataclass(frozen=True)
class QwenVLImages:
    """Qwen2-VL / Qwen2.5-VL's image processor (preprocessor_config.json), as numbers."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280  # the class default; Qwen2.5-VL's preprocessor_config.json says 12,845,056
    channels: int = 3

    @classmethod
    def from_preprocessor(cls, config: dict[str, Any]) -> QwenVLImages:
        """From a preprocessor_config.json dict (its `min_pixels` / `max_pixels`, or `size` in the newer form)."""
        size = config.get("size") or {}
        return cls(
            patch_size=int(config.get("patch_size", 14)),
            merge_size=int(config.get("merge_size", 2)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_values(self) -> int:
        """Numbers in one row of pixel_values: channels × temporal patch × patch × patch (1176)."""
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

    def tokens(self, height: int, width: int, max_pixels: int | None = None) -> int:
        """Image tokens in the decoder's sequence for one image: patches // merge²."""
        return self.patches(height, width, max_pixels) // self.merge_size**2

    def max_tokens(self, max_pixels: int | None = None) -> int:
        """The most tokens one image can become under `max_pixels` (any aspect ratio)."""
        return (max_pixels or self.max_pixels) // self.factor**2


@dataclass(frozen=True)
class VisionFamily:
    """A vision-language family lowmem-ft trains on images."""

    model_type: str
    name: str  # for messages
    image_token: str  # the placeholder the chat template renders once per image and the processor repeats
    image_token_key: str  # the config key of its id


# model_type → family. Qwen2-VL shares the processor and the tokens (processing_qwen2_vl.py); only Qwen2.5-VL's
# tower is described by the memory model (`lowmem_ft.memory.vision`), so Qwen2-VL is refused until it is.
VISION_FAMILIES = {
    "qwen2_5_vl": VisionFamily("qwen2_5_vl", "Qwen2.5-VL", "<|image_pad|>", "image_token_id"),
}
# the multimodal model_types transformers 5.24 knows, by family name, for the refusal
KNOWN_VLMS = {
    "qwen2_vl": "Qwen2-VL", "qwen3_vl": "Qwen3-VL", "gemma3": "Gemma-3", "idefics3": "Idefics3",
    "smolvlm": "SmolVLM", "llava": "LLaVA", "llava_next": "LLaVA-NeXT", "llava_onevision": "LLaVA-OneVision",
    "mllama": "Llama-3.2-Vision", "paligemma": "PaliGemma", "mistral3": "Mistral-3 (Pixtral)",
    "aya_vision": "Aya Vision", "internvl": "InternVL", "glm4v": "GLM-4V", "cohere2_vision": "Command-A Vision",
}  # fmt: skip


def vision_family(model_type: str, model: str = "") -> VisionFamily:
    """The family of a vision-language checkpoint, or one line naming the family lowmem-ft does not train on images."""
    family = VISION_FAMILIES.get(model_type)
    if family is not None:
        return family
    name = KNOWN_VLMS.get(model_type, f"model_type {model_type!r}")
    trained = ", ".join(f.name for f in VISION_FAMILIES.values())
    raise UserError(
        f"model '{model}': lowmem-ft does not train {name} on images yet (vision-language training supports "
        f"{trained}); use a {trained} checkpoint"
    )


def image_arithmetic(preprocessor: dict[str, Any]) -> QwenVLImages:
    """The image-token arithmetic of a preprocessor_config.json."""
    return QwenVLImages.from_preprocessor(preprocessor)
