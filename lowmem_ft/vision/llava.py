"""LLaVA-1.5's images as numbers: every image is the same fixed crop, so the same number of tokens (the
`ImageArithmetic` of `lowmem_ft.vision.families`). Pure arithmetic but `process` (the collator's call into
transformers).

The rule, read in transformers 5.24: the image processor (llava-1.5-7b-hf ships `CLIPImageProcessor`; the PIL one,
image_processing_pil_clip.py, needs no torchvision) resizes the shortest edge to `size.shortest_edge` and center-
crops to `crop_size` (336 × 336); `LlavaProcessor.replace_image_token` (processing_llava.py) repeats `<image>`
(crop_h / patch) · (crop_w / patch) + num_additional_image_tokens times, minus one under
`vision_feature_select_strategy` "default" — what `LlavaModel.get_image_features` keeps: the CLIP tower's hidden
state at `vision_feature_layer` (−2) without its class token. 336 / 14 = 24, 24² = 576 tokens per image.

There is no resolution knob: `vision.max_pixels` cannot change the crop, so the planner has one cap to choose, the
crop's area, and the plan says the tokens are fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowmem_ft.vision.fixed import FixedResolution


@dataclass(frozen=True)
class LlavaImages(FixedResolution):
    """LLaVA-1.5's image processor (preprocessor_config.json) and the tower's tokens per image."""

    crop_height: int = 336
    crop_width: int = 336
    patch: int = 14  # the CLIP tower's patch_size
    class_token: bool = False  # vision_feature_select_strategy "full" keeps the CLS feature; "default" drops it
    channels: int = 3
    placeholder: str = "<image>"  # what the chat template renders once per image
    image_token: str = "<image>"  # repeated once per feature by the processor

    @classmethod
    def from_preprocessor(cls, preprocessor: dict[str, Any], config: dict[str, Any] | None = None) -> LlavaImages:
        config = config or {}
        crop = preprocessor.get("crop_size") if preprocessor.get("do_center_crop", True) else preprocessor.get("size")
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        crop = crop or {}
        vision = config.get("vision_config") or {}
        return cls(
            crop_height=int(crop.get("height", cls.crop_height)),
            crop_width=int(crop.get("width", cls.crop_width)),
            patch=int(vision.get("patch_size", cls.patch)),
            class_token=config.get("vision_feature_select_strategy", "default") == "full",
        )

    # -- the knob: none --------------------------------------------------------------------------------------------
    @property
    def max_pixels(self) -> int:
        return self.crop_height * self.crop_width

    def describe(self, max_pixels: int | None = None) -> str:
        return f"fixed: every image cropped to {self.crop_width}×{self.crop_height}, {self.max_tokens()} tokens"

    def _how(self) -> str:
        return f"vision.max_pixels {self.max_pixels} ({self.describe()}); vision.max_pixels does not apply"

    # -- one image ------------------------------------------------------------------------------------------------
    def tokens(self, height: int = 0, width: int = 0, max_pixels: int | None = None, images_in_sample: int = 1) -> int:
        """Image tokens for any image: the crop's patches (and the class token under "full")."""
        return (self.crop_height // self.patch) * (self.crop_width // self.patch) + int(self.class_token)

    def max_tokens(self, max_pixels: int | None = None) -> int:
        return self.tokens()

    @property
    def patches_per_token(self) -> int:
        """Tower patches behind one image token: the projector maps each patch's features to one token."""
        return 1

    def patches(self, height: int = 0, width: int = 0, max_pixels: int | None = None) -> int:
        """The tower's sequence for one image: its patches and the class token."""
        return (self.crop_height // self.patch) * (self.crop_width // self.patch) + 1

    def expansion(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> str:
        return "<image>" * self.tokens()

    # -- the processor ---------------------------------------------------------------------------------------------
    def process(self, processor, images: list[list], cap: int) -> tuple[dict[str, Any], list[int]]:
        """(pixel_values (images, 3, crop, crop) of every image of the batch, in order; the tokens each makes),
        checked to be the crop the token count assumes."""
        del cap
        flat = [image for sample in images for image in sample]
        out = processor(images=flat, return_tensors="pt")
        made = tuple(out["pixel_values"].shape[-2:])
        if made != (self.crop_height, self.crop_width):  # the arithmetic and the processor disagree: never trained
            raise RuntimeError(
                f"image processor made {made} crops, the data assumes {self.crop_height, self.crop_width}"
            )
        return {"pixel_values": out["pixel_values"]}, [self.tokens()] * len(flat)

    def image_units(self, inputs: dict[str, Any]) -> tuple[list[int], dict[str, list[int]]]:
        """(image tokens of each image in the batch, in order; for each per-unit input, its first-dimension
        entries per unit): what `VisionCollator.split` cuts a micro batch by."""
        n = inputs["pixel_values"].shape[0]  # one crop per image
        return [self.tokens()] * n, {"pixel_values": [1] * n}

    def text_inputs(self, input_ids, image_token_id: int) -> dict[str, Any]:
        del input_ids, image_token_id
        return {}
