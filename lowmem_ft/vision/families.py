"""What lowmem-ft knows about each vision-language family it trains on images: one `VisionFamily` per transformers
`model_type`, whose `images` class is that family's processor arithmetic (`lowmem_ft.vision.qwen_vl`,
`lowmem_ft.vision.gemma3`, `lowmem_ft.vision.idefics3`, `lowmem_ft.vision.llava`, `lowmem_ft.vision.llava_onevision`),
and the one line that refuses any other VLM by its family name (and why, where it is more than "not yet"). Pure
arithmetic (the memory model and `plan` read it).

An arithmetic class (`ImageArithmetic`) says how many tokens an image becomes (`tokens`: the `image_token`s that carry
its features, in every family; markers around them count in the sample's length only), the text the chat
template's placeholder expands to (`expansion`), the resolution caps the planner may choose (`caps`), and how the
checkpoint's image processor is called (`process`, one list of images per sample: Idefics3 pads tiles per sample,
LLaVA-OneVision tiles a sample's only image but not one of several); a new family is one module and one line in
`VISION_FAMILIES`. `images_in_sample` is there for LLaVA-OneVision, whose tokens per image depend on it; the other
families ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lowmem_ft.errors import UserError
from lowmem_ft.vision.gemma3 import Gemma3Images
from lowmem_ft.vision.idefics3 import Idefics3Images
from lowmem_ft.vision.llava import LlavaImages
from lowmem_ft.vision.llava_onevision import AnyresImages
from lowmem_ft.vision.qwen_vl import QwenVLImages


class ImageArithmetic(Protocol):
    placeholder: str  # what the chat template renders once per image
    image_token: str  # what the image's features replace in the decoder's sequence
    max_pixels: int  # the checkpoint's own cap
    patches_per_token: int  # the tower's patches (pixel_values rows) behind one image token

    def tokens(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> int: ...
    def max_tokens(self, max_pixels: int | None = None) -> int: ...
    def expansion(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> str: ...
    def default_cap(self) -> tuple[int, str]: ...
    def cap_why(self, cap: int) -> str: ...
    def caps(self, ceiling: int) -> list[int]: ...
    def with_cap(self, config: dict[str, Any], cap: int) -> dict[str, Any]: ...
    def at_cap(self, cap: int) -> ImageArithmetic: ...
    # images: one list per sample; returns (the model's image inputs, tokens made per image, in order)
    def process(self, processor, images: list[list], cap: int) -> tuple[dict[str, Any], list[int]]: ...
    def text_inputs(self, input_ids, image_token_id: int) -> dict[str, Any]: ...
    # (image tokens of each image unit of a batch; per input that is not one row per sample, its entries per unit)
    def image_units(self, inputs: dict[str, Any]) -> tuple[list[int], dict[str, list[int]]]: ...


@dataclass(frozen=True)
class VisionFamily:
    """A vision-language family lowmem-ft trains on images."""

    model_type: str
    name: str  # for messages
    arithmetic: type  # its `ImageArithmetic`, built `from_preprocessor(preprocessor_config, config)`
    # True: trained on images only when the data has them (Gemma-3 trains as text on text data, as before)
    text_too: bool = False

    def images(self, preprocessor: dict[str, Any], config: dict[str, Any] | None = None) -> ImageArithmetic:
        """The checkpoint's image arithmetic, from its preprocessor_config.json and config.json dicts."""
        return self.arithmetic.from_preprocessor(preprocessor, config or {})


# model_type → family
VISION_FAMILIES = {
    "qwen2_vl": VisionFamily("qwen2_vl", "Qwen2-VL", QwenVLImages),
    "qwen2_5_vl": VisionFamily("qwen2_5_vl", "Qwen2.5-VL", QwenVLImages),
    "qwen3_vl": VisionFamily("qwen3_vl", "Qwen3-VL", QwenVLImages),
    "gemma3": VisionFamily("gemma3", "Gemma-3", Gemma3Images, text_too=True),
    "idefics3": VisionFamily("idefics3", "Idefics3 / SmolVLM", Idefics3Images),
    "smolvlm": VisionFamily("smolvlm", "SmolVLM2", Idefics3Images),
    "llava": VisionFamily("llava", "LLaVA-1.5", LlavaImages),
    "llava_onevision": VisionFamily("llava_onevision", "LLaVA-OneVision", AnyresImages),
}
# the multimodal model_types transformers 5.24 knows, by family name, for the refusal
KNOWN_VLMS = {
    "qwen2_vl": "Qwen2-VL", "qwen3_vl": "Qwen3-VL", "gemma3": "Gemma-3", "idefics3": "Idefics3",
    "smolvlm": "SmolVLM", "llava": "LLaVA", "llava_next": "LLaVA-NeXT", "llava_onevision": "LLaVA-OneVision",
    "mllama": "Llama-3.2-Vision", "paligemma": "PaliGemma", "mistral3": "Mistral-3 (Pixtral)",
    "aya_vision": "Aya Vision", "internvl": "InternVL", "glm4v": "GLM-4V", "cohere2_vision": "Command-A Vision",
}  # fmt: skip
# why a known family is not trained on images, where it is more than "not yet"
NOT_TRAINED_WHY = {
    "mllama": "its decoder reads the image through cross-attention layers, not as tokens of its sequence, so the "
    "image-token plan does not describe it",
    "llava_next": "its anyres tiling (image_grid_pinpoints) is not described yet",
}


def vision_family(model_type: str, model: str = "") -> VisionFamily:
    """The family of a vision-language checkpoint, or one line naming the family lowmem-ft does not train on images."""
    family = VISION_FAMILIES.get(model_type)
    if family is not None:
        return family
    name = KNOWN_VLMS.get(model_type, f"model_type {model_type!r}")
    trained = ", ".join(f.name for f in VISION_FAMILIES.values())
    why = f": {NOT_TRAINED_WHY[model_type]}" if model_type in NOT_TRAINED_WHY else ""
    raise UserError(
        f"model '{model}': lowmem-ft does not train {name} on images yet{why} (vision-language training supports "
        f"{trained}); use a checkpoint of one of those"
    )
