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
from lowmem_ft.vision.families import ImageArithmetic, VisionFamily, vision_family
from lowmem_ft.vision.images import BadImage, open_image


@dataclass
class ImagePrompt:
    tokenizer: Any
    family: VisionFamily
    images: ImageArithmetic
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
        images = family.images(json.loads(saved.read_text(encoding="utf-8")), config)
        checked = []
        for path in paths:
            try:
                checked.append(open_image(path, Path.cwd()).path)
            except BadImage as exc:
                raise UserError(f"--image {path}: {exc}") from None
        return cls(tokenizer, family, images, AutoImageProcessor.from_pretrained(saved.parent), checked)

    def encode(self, messages: list[dict[str, Any]]):
        """input_ids, attention_mask and the image inputs (`ImageArithmetic.process`) of the conversation."""
        import torch

        from lowmem_ft.vision.images import load_rgb

        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        cap = self.images.max_pixels  # the saved preprocessor_config.json's: the cap the run trained at
        inputs, counts = self.images.process(self.processor, [[load_rgb(p) for p in self.paths]], cap)
        pieces = text.split(self.images.placeholder)
        if len(pieces) - 1 != len(counts):
            raise UserError(
                f"--image: the chat template rendered {len(pieces) - 1} image placeholder(s) for {len(counts)} image(s)"
            )
        sizes = [open_image(p, Path.cwd()) for p in self.paths]
        expanded = pieces[0] + "".join(
            self.images.expansion(f.height, f.width, cap, len(sizes)) + piece
            for f, piece in zip(sizes, pieces[1:], strict=True)
        )
        input_ids = torch.tensor([self.tokenizer(expanded, add_special_tokens=False)["input_ids"]])
        image_id = self.tokenizer.convert_tokens_to_ids(self.images.image_token)
        if int((input_ids == image_id).sum()) != sum(counts):  # the arithmetic and the processor disagree: a bug
            raise RuntimeError(f"image processor made {counts} tokens per image, the prompt holds another count")
        extra = self.images.text_inputs(input_ids, image_id)
        return _Batch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **extra, **inputs)


class _Batch(dict):
    """What `Generator.reply` takes from `encode`: a mapping with `.to(device)`."""

    def to(self, device):
        return _Batch({k: v.to(device) for k, v in self.items()})
