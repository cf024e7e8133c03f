"""`generate --image PATH`: a prompt with images for a vision-language fine-tune, encoded as training encoded its
samples — the chat template's placeholders expanded to the processor's token count at the cap the run trained at
(the preprocessor_config.json saved beside its weights), the pixel values beside them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.vision.families import QwenVLImages, VisionFamily, image_arithmetic, vision_family
from lowmem_ft.vision.images import BadImage, open_image


@dataclass
class ImagePrompt:
    tokenizer: Any
    family: VisionFamily
    images: QwenVLImages
    processor: Any
    paths: list[str]

    @classmethod
    def of_run(cls, run, tokenizer, paths: list[str]) -> ImagePrompt:
        from transformers import AutoImageProcessor

        from lowmem_ft.memory.arch import load_config_dict

        config, _ = load_config_dict(run.base)
        family = vision_family(str(config.get("model_type", "")), run.base)
        saved = Path(run.weights_dir) / "preprocessor_config.json"
        if not saved.is_file():
            raise UserError(f"--image: {run.weights_dir} has no preprocessor_config.json (not an image run)")
        images = image_arithmetic(json.loads(saved.read_text(encoding="utf-8")))
        checked = []
        for path in paths:
            try:
                checked.append(open_image(path, Path.cwd()).path)
            except BadImage as exc:
                raise UserError(f"--image {path}: {exc}") from None
        return cls(tokenizer, family, images, AutoImageProcessor.from_pretrained(saved.parent), checked)

    def encode(self, messages: list[dict[str, Any]]):
        """input_ids, attention_mask, pixel_values and image_grid_thw of the conversation with its images."""
        import torch

        from lowmem_ft.vision.images import load_rgb

        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        size = {"shortest_edge": self.images.min_pixels, "longest_edge": self.images.max_pixels}
        pixels = self.processor(images=[load_rgb(p) for p in self.paths], size=size, return_tensors="pt")
        counts = (pixels["image_grid_thw"].prod(-1) // self.images.merge_size**2).tolist()
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        pad = self.tokenizer.convert_tokens_to_ids(self.family.image_token)
        expanded: list[int] = []
        k = 0
        for token in ids:
            if token == pad and k < len(counts):
                expanded += [pad] * counts[k]
                k += 1
            else:
                expanded.append(token)
        if k != len(counts):
            raise UserError(f"--image: the chat template rendered {k} image placeholder(s) for {len(counts)} image(s)")
        input_ids = torch.tensor([expanded])
        return _Batch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                      pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])  # fmt: skip


class _Batch(dict):
    """What `Generator.reply` takes from `encode`: a mapping with `.to(device)`."""

    def to(self, device):
        return _Batch({k: v.to(device) for k, v in self.items()})
