"""Gemma-3's image processor as numbers (gemma-3-4b-it and larger: a SigLIP tower beside the gemma3 text model):
how many tokens an image becomes, the text its placeholder expands to, and the processor call that makes the
pixels and the token types. Pure arithmetic but `process` / `text_inputs` (the collator's torch calls).

The one idea: Gemma-3 has no resolution knob. Every image (and every pan-and-scan crop of it) is resized to the
tower's square (896×896 on the Hub's checkpoints, `preprocessor_config.json` `size`), the tower's 64×64 patches are
average-pooled to `mm_tokens_per_image` (256) features (`Gemma3MultiModalProjector`), and the decoder gets exactly
that many `<image_soft_token>` per crop. Read in transformers 5.24:

- `processing_gemma3.py`: the chat template renders `<start_of_image>` (the tokenizer's boi token) per image; the
  processor replaces it with `full_image_sequence` = "\\n\\n<start_of_image>" + 256 × "<image_soft_token>" +
  "<end_of_image>\\n\\n"; with pan-and-scan crops, "Here is the original image {seq} and here are some crops to help
  you see better " + " ".join([seq] * crops). `token_type_ids` are 1 at the soft tokens (`create_mm_token_type_ids`),
  and the model attends bidirectionally within each image's block of them (`get_block_sequence_ids_for_mask`).
- `image_processing_pil_gemma3.py` `pan_and_scan`: off unless the processor asks (`Gemma3Processor.images_kwargs`:
  do_pan_and_scan False, min crop 256, at most 4 crops, aspect ratio ≥ 1.2 to activate); the crop count is `crops`
  below, from the image's own (height, width) before any resize.

Checked against the processor and the model on the zoo checkpoint (tests/vision/test_vision_gemma3.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lowmem_ft.vision.fixed import FixedResolution

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"  # Gemma-3 tokenizer_config.json
# Gemma3Processor.images_kwargs: what a preprocessor_config.json's nulls mean
PAN_AND_SCAN = {"do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}  # fmt: skip


@dataclass(frozen=True)
class Gemma3Images(FixedResolution):
    """Gemma-3's image processor (preprocessor_config.json) and the tokens per crop (config.json)."""

    image_size: int = 896  # every crop is resized to image_size × image_size
    tokens_per_crop: int = 256  # config.json mm_tokens_per_image (the processor's image_seq_length)
    pan_and_scan: bool = False
    min_crop_size: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2
    channels: int = 3
    patch_size: int = 14  # config.json vision_config.patch_size (SigLIP's Conv2d stride)
    placeholder: str = BOI
    image_token: str = SOFT

    @classmethod
    def from_preprocessor(cls, config: dict[str, Any], model_config: dict[str, Any] | None = None) -> Gemma3Images:
        size = config.get("size") or {}
        pas = {k: config.get(k) if config.get(k) is not None else v for k, v in PAN_AND_SCAN.items()}
        return cls(
            image_size=int(size.get("height", 896)),
            tokens_per_crop=int((model_config or {}).get("mm_tokens_per_image") or config.get("image_seq_length", 256)),
            pan_and_scan=bool(pas["do_pan_and_scan"]),
            min_crop_size=int(pas["pan_and_scan_min_crop_size"]),
            max_crops=int(pas["pan_and_scan_max_num_crops"]),
            min_ratio=float(pas["pan_and_scan_min_ratio_to_activate"]),
            patch_size=int(((model_config or {}).get("vision_config") or {}).get("patch_size", 14)),
        )

    @property
    def max_pixels(self) -> int:
        """The pixels the tower sees of one image at most: the original's square and each crop's."""
        return self.image_size**2 * (1 + (self.max_crops if self.pan_and_scan else 0))

    @property
    def patches_per_token(self) -> int:
        """SigLIP patches behind one soft token: a crop's (image_size / patch)² patches pooled to tokens_per_crop
        (Gemma3MultiModalProjector's average pooling; 4,096 → 256 = 16 on the Hub's checkpoints)."""
        return (self.image_size // self.patch_size) ** 2 // self.tokens_per_crop

    def crops(self, height: int, width: int) -> int:
        """Pan-and-scan crops of an image (`Gemma3ImageProcessorPil.pan_and_scan`); 0 when it is off."""
        if not self.pan_and_scan:
            return 0
        long, short = max(height, width), min(height, width)
        if long / short < self.min_ratio:
            return 0
        n = int(math.floor(long / short + 0.5))  # half round up
        n = min(int(math.floor(long / self.min_crop_size)), n)
        n = min(self.max_crops, max(2, n))
        crop_long = int(math.ceil(long / n))
        return 0 if min(crop_long, short) < self.min_crop_size else n

    def tokens(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> int:
        """Image tokens (soft tokens) in the decoder's sequence for one image: tokens per crop × (1 + crops).
        `max_pixels` does not apply: every crop is resized to the same square."""
        del max_pixels, images_in_sample
        return self.tokens_per_crop * (1 + self.crops(height, width))

    def max_tokens(self, max_pixels: int | None = None) -> int:
        del max_pixels
        return self.tokens_per_crop * (1 + (self.max_crops if self.pan_and_scan else 0))

    def expansion(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> str:
        """`Gemma3Processor.replace_image_token`: the text where the template rendered <start_of_image>."""
        del max_pixels, images_in_sample
        sequence = f"\n\n{BOI}{SOFT * self.tokens_per_crop}{EOI}\n\n"
        crops = self.crops(height, width)
        if not crops:
            return sequence
        crops_text = " ".join([sequence] * crops)
        return f"Here is the original image {sequence} and here are some crops to help you see better {crops_text}"

    # -- the resolution: fixed -----------------------------------------------------------------------------------
    def _how(self) -> str:
        pas = (
            f"pan-and-scan on: up to {self.max_crops} crops more of a long image"
            if self.pan_and_scan
            else "pan-and-scan off"
        )
        return (
            f"Gemma-3 resizes every image to {self.image_size}×{self.image_size}: {self.tokens_per_crop} tokens per "
            f"image ({pas}, preprocessor_config.json); vision.max_pixels does not apply"
        )

    # -- the processor call (torch) ---------------------------------------------------------------------------------
    def process(self, processor, images: list[list], cap: int) -> tuple[dict[str, Any], list[int]]:
        """(pixel_values: one 3 × size × size fp32 image per crop, tokens the processor made per image). The
        pan-and-scan settings are passed as this arithmetic read them (the image processor alone leaves them None)."""
        del cap
        flat = [image for sample in images for image in sample]
        out = processor(
            images=flat, return_tensors="pt", do_pan_and_scan=self.pan_and_scan,
            pan_and_scan_min_crop_size=self.min_crop_size, pan_and_scan_max_num_crops=self.max_crops,
            pan_and_scan_min_ratio_to_activate=self.min_ratio,
        )  # fmt: skip
        made = [self.tokens_per_crop * (1 + int(n)) for n in out["num_crops"]]
        return {"pixel_values": out["pixel_values"]}, made

    def image_units(self, inputs: dict[str, Any]) -> tuple[list[int], dict[str, list[int]]]:
        """(image tokens of each crop in the batch, in order; for each per-unit input, its first-dimension
        entries per unit): what `VisionCollator.split` cuts a micro batch by."""
        crops = inputs["pixel_values"].shape[0]  # one square per crop, each its own run of soft tokens
        return [self.tokens_per_crop] * crops, {"pixel_values": [1] * crops}

    def text_inputs(self, input_ids, image_token_id: int) -> dict[str, Any]:
        """token_type_ids: 1 at the soft tokens (Gemma3Processor's), which the model attends to bidirectionally."""
        return {"token_type_ids": (input_ids == image_token_id).long()}
