"""The ViT towers of vision-language families beside Qwen2.5-VL's (`lowmem_ft.memory.vision`): their weights and
nn.Linear layers, from config.json. Pure arithmetic (no torch).

Both towers are the same pre-LayerNorm ViT: a patch Conv2d, learned position embeddings, `num_hidden_layers`
encoder layers of LayerNorm → q/k/v/out_proj (hidden → hidden, each with a bias) → LayerNorm → fc1 (hidden →
intermediate) / fc2 (back), both with biases, and a final LayerNorm. They differ in the ends and in the connector:

- Idefics3 / SmolVLM (modeling_idefics3.py / modeling_smolvlm.py, transformers 5.24): the SigLIP-style
  `Idefics3VisionTransformer` (patch Conv2d with bias, (image_size / patch)² positions, `post_layernorm`) and the
  `Idefics3Connector`: a pixel shuffle (no weights) folding scale_factor² neighbouring patches into one token, then
  one Linear(vision hidden · scale_factor² → text hidden, no bias).
- LLaVA-1.5 (modeling_llava.py + modeling_clip.py): `CLIPVisionModel` (a class embedding, patch Conv2d without bias,
  (image_size / patch)² + 1 positions, `pre_layrnorm` and `post_layernorm`: all loaded, the post norm never run
  for features taken at layer −2) and `LlavaMultiModalProjector`: Linear(vision hidden · feature layers → text
  hidden) → GELU → Linear(text hidden → text hidden), biased by `multimodal_projector_bias` (default true).

Counts equal the models transformers builds on the meta device, tiny and published configs
(tests/memory/test_vision_towers.py). The towers are frozen (`lowmem_ft.train.model.beside_language_model`), so
their forward records no graph; what they leave is the image features scattered into the decoder's input
embeddings, which the decoder terms count over text + image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowmem_ft.memory.blocks import Linear

# transformers 5.24's vision config class defaults (configuration_idefics3.py Idefics3VisionConfig, the same in
# configuration_smolvlm.py, configuration_clip.py CLIPVisionConfig) for the keys a config.json may omit
IDEFICS3_VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32}  # fmt: skip
CLIP_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                        "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32}  # fmt: skip


@dataclass(frozen=True)
class ViTTower:
    """A pre-LayerNorm ViT and its connector to the decoder, as the memory model counts them."""

    family: str  # "idefics3" | "llava" | "siglip" (LLaVA-OneVision)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    channels: int
    image_size: int  # one tile / crop, square
    patch: int
    connector: tuple[Linear, ...]
    extra_params: int = 0  # outside the layers and the connector's linears: OneVision's image_newline, SigLIP's head
    head_linears: tuple[Linear, ...] = ()  # SigLIP's attention-pooling head's nn.Linear layers (vision_use_head)

    @property
    def patches(self) -> int:
        """Patches of one tile (the tower's sequence, without a class token)."""
        return (self.image_size // self.patch) ** 2

    @property
    def linears(self) -> tuple[Linear, ...]:
        h, i = self.hidden, self.intermediate
        layer = tuple(Linear(n, h, h, True) for n in ("q_proj", "k_proj", "v_proj", "out_proj")) + (
            Linear("fc1", h, i, True),
            Linear("fc2", i, h, True),
        )
        return layer * self.layers + self.head_linears + self.connector

    @property
    def params(self) -> int:
        h = self.hidden
        norms = (2 * self.layers + 1) * 2 * h  # layer_norm1/2 per layer and post_layernorm: weight and bias
        conv = self.channels * self.patch**2 * h
        if self.family == "llava":  # class embedding, no conv bias, a position for the class token, pre_layrnorm
            embeddings = h + conv + (self.patches + 1) * h + 2 * h
        else:
            embeddings = conv + h + self.patches * h
        return embeddings + norms + sum(lin.params for lin in self.linears) + self.extra_params

    def pixel_bytes(self, tiles: int) -> int:
        """fp32 pixel values of `tiles` tiles (the image processor's output)."""
        return 4 * tiles * self.channels * self.image_size**2


def _vision(config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    return {**defaults, **(config.get("vision_config") or {})}


def idefics3_tower(config: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """The Architecture fields of an Idefics3 / SmolVLM config.json's vision tower and connector."""
    v = _vision(config, IDEFICS3_VISION_DEFAULTS)  # SmolVLMVisionConfig has the same defaults
    h, scale = int(v["hidden_size"]), int(config.get("scale_factor", 2))
    tower = ViTTower(
        "idefics3", h, int(v["intermediate_size"]), int(v["num_hidden_layers"]), int(v["num_attention_heads"]),
        int(v["num_channels"]), int(v["image_size"]), int(v["patch_size"]),
        connector=(Linear("proj", h * scale * scale, text_hidden, False),),
    )  # fmt: skip
    return {"tower_params": tower.params, "tower_linears": tower.linears, "vision": tower}


def llava_tower(config: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """The Architecture fields of a LLaVA config.json's CLIP tower and two-layer projector."""
    v = _vision(config, CLIP_VISION_DEFAULTS)
    h = int(v["hidden_size"])
    layer = config.get("vision_feature_layer", -2)
    feature_layers = 1 if isinstance(layer, int) else len(layer)
    bias = bool(config.get("multimodal_projector_bias", True))
    tower = ViTTower(
        "llava", h, int(v["intermediate_size"]), int(v["num_hidden_layers"]), int(v["num_attention_heads"]),
        int(v["num_channels"]), int(v["image_size"]), int(v["patch_size"]),
        connector=(Linear("linear_1", h * feature_layers, text_hidden, bias),
                   Linear("linear_2", text_hidden, text_hidden, bias)),
    )  # fmt: skip
    return {"tower_params": tower.params, "tower_linears": tower.linears, "vision": tower}


# LlavaOnevisionConfig's vision_config defaults (configuration_llava_onevision.py sub_configs_defaults: SigLIP so400m
# without its last layer and head) over SiglipVisionConfig's
SIGLIP_ONEVISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26,
                             "num_attention_heads": 16, "num_channels": 3, "image_size": 384, "patch_size": 14,
                             "vision_use_head": False}  # fmt: skip


def llava_onevision_tower(config: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """The Architecture fields of a LLaVA-OneVision config.json: SiglipVisionModel (modeling_siglip.py: patch Conv2d
    with bias, (image_size / patch)² positions, post_layernorm, the attention-pooling head when vision_use_head:
    probe, nn.MultiheadAttention's in-projection and out_proj, a LayerNorm, fc1 / fc2), the projector (Linear,
    GELU, Linear, biased by multimodal_projector_bias) and `image_newline`, one text-width vector."""
    v = _vision(config, SIGLIP_ONEVISION_DEFAULTS)
    h, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    layer = config.get("vision_feature_layer", -1)
    feature_layers = 1 if isinstance(layer, int) else len(layer)
    bias = bool(config.get("multimodal_projector_bias", True))
    head: tuple[Linear, ...] = ()
    extra = text_hidden  # image_newline
    if v.get("vision_use_head", True):
        head = (Linear("out_proj", h, h, True), Linear("fc1", h, inter, True), Linear("fc2", inter, h, True))
        extra += h + 3 * h * h + 3 * h + 2 * h  # probe, in_proj weight and bias, layernorm
    tower = ViTTower(
        "siglip", h, inter, int(v["num_hidden_layers"]), int(v["num_attention_heads"]), int(v["num_channels"]),
        int(v["image_size"]), int(v["patch_size"]),
        connector=(Linear("linear_1", h * feature_layers, text_hidden, bias),
                   Linear("linear_2", text_hidden, text_hidden, bias)),
        extra_params=extra, head_linears=head,
    )  # fmt: skip
    return {"tower_params": tower.params, "tower_linears": tower.linears, "vision": tower}


# model_type of the wrapper → (the tower reader, the model_type its text_config defaults to: transformers 5.24
# Idefics3Config / SmolVLMConfig / LlavaConfig sub_configs_defaults say llama, LlavaOnevisionConfig qwen2)
VIT_TOWERS = {"idefics3": (idefics3_tower, "llama"), "smolvlm": (idefics3_tower, "llama"),
              "llava": (llava_tower, "llama"), "llava_onevision": (llava_onevision_tower, "qwen2")}  # fmt: skip
