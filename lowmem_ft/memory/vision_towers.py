"""The plain-ViT towers of vision-language families (SigLIP, CLIP) beside the Qwen-VL ones (`lowmem_ft.memory.vision`):
their weights and nn.Linear layers, and what running them costs per patch, as one `ViTTower`. Pure arithmetic over
config.json (no torch).

Every tower here is the same pre-LayerNorm ViT: a patch Conv2d, learned position embeddings, `num_hidden_layers`
encoder layers of LayerNorm → q/k/v/out_proj (hidden → hidden, each with a bias) → LayerNorm → fc1 (hidden →
intermediate) / fc2 (back), both with biases, and a final LayerNorm. They differ in the ends, in the connector, and
in what the model's `get_image_features` keeps around the tower (transformers 5.24):

- Gemma-3 (modeling_gemma3.py + modeling_siglip.py): SigLIP (patch Conv2d with bias, post_layernorm, the
  attention-pooling head when `vision_use_head`) and Gemma3MultiModalProjector (average pooling to
  mm_tokens_per_image, an RMSNorm and a vision × text `mm_input_projection_weight`).
- Idefics3 / SmolVLM (modeling_idefics3.py / modeling_smolvlm.py): the SigLIP-style `Idefics3VisionTransformer` and
  `Idefics3Connector`: a pixel shuffle (no weights) folding scale_factor² neighbouring patches into one token, then
  one Linear(vision hidden · scale_factor² → text hidden, no bias). `get_image_features` casts the tiles to the
  compute dtype and copies the real (non-padding) ones, and copies the pixel mask (the processor's int64 per pixel):
  both alive through the tower.
- LLaVA-1.5 (modeling_llava.py + modeling_clip.py): `CLIPVisionModel` (a class embedding, patch Conv2d without bias,
  (image_size / patch)² + 1 positions, `pre_layrnorm` and `post_layernorm`) and `LlavaMultiModalProjector`:
  Linear(vision hidden · feature layers → text hidden) → GELU → Linear(text hidden → text hidden), biased by
  `multimodal_projector_bias` (default true). The features come from layer −2: transformers 5.24 records only the
  selected layers' hidden states (`select_hidden_states`), so one more hidden state per feature layer is kept, not
  every layer's (measured: the tower's working set and what it leaves do not change with its depth).
- LLaVA-OneVision (modeling_llava_onevision.py + modeling_siglip.py): SigLIP without its head, the same projector,
  `image_newline`; `get_image_features` concatenates each image's crops (an fp32 copy of the pixel values, alive
  through the tower), takes the recorded last layer's hidden states and packs the projected features (unpadded
  grid, a newline per row, the base crop) into new tensors.

What running one costs, per patch (one patch² square of one tile or crop), read from that code and measured with
PeakMemory on the CPU (tests/vision/test_vision_memory.py): frozen, SDPA (linear in the patches; eager's per-crop
patches² scores are not priced). The counts equal the models transformers builds on the meta device
(tests/memory/test_vision_towers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lowmem_ft.memory.blocks import Linear
from lowmem_ft.memory.vision import mlp_intermediates

# transformers 5.24's vision config class defaults for the keys a config.json may omit: SiglipVisionConfig
# (configuration_siglip.py; Gemma-3), Idefics3VisionConfig (the same in configuration_smolvlm.py), CLIPVisionConfig
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "vision_use_head": True,
                   "hidden_act": "gelu_pytorch_tanh"}  # fmt: skip
IDEFICS3_VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
                            "hidden_act": "gelu_pytorch_tanh"}  # fmt: skip
CLIP_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                        "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
                        "hidden_act": "quick_gelu"}  # fmt: skip
# LlavaOnevisionConfig's vision_config defaults (configuration_llava_onevision.py sub_configs_defaults: SigLIP so400m
# without its last layer and head) over SiglipVisionConfig's
SIGLIP_ONEVISION_DEFAULTS = {**SIGLIP_DEFAULTS, "hidden_size": 1152, "intermediate_size": 4304,
                             "num_hidden_layers": 26, "num_attention_heads": 16, "image_size": 384, "patch_size": 14,
                             "vision_use_head": False}  # fmt: skip


@dataclass(frozen=True)
class ViTTower:
    """A plain ViT tower and the connector that hands its features on, described per patch as `VisionTower` is, so
    `lowmem_ft.memory.tower` prices it unchanged. `patches_per_token` is how many patches the connector turns into
    one image token (Gemma-3's average pooling 16, Idefics3's pixel shuffle scale², CLIP and SigLIP-OneVision 1),
    `out_hidden` the features' width."""

    family: str  # "gemma3" | "idefics3" | "llava" | "llava_onevision": what get_image_features keeps around it
    hidden: int
    intermediate: int
    depth: int
    heads: int
    channels: int
    image_size: int  # one tile / crop, square
    patch: int
    out_hidden: int
    patches_per_token: int
    connector: tuple[Linear, ...] = ()
    head_linears: tuple[Linear, ...] = ()  # SigLIP's attention-pooling head's nn.Linear layers (vision_use_head)
    extra_params: int = 0  # outside the layers and the linears: the pooling head's rest, a projector weight, newline
    act_intermediates: int = 2  # at the MLP moment: gelu_pytorch_tanh 2, QuickGELU 3 (`mlp_intermediates`)
    recorded: int = 0  # hidden states the connector selects from the recorded layers (LLaVA's −2, OneVision's −1)

    @property
    def class_token(self) -> bool:
        return self.family == "llava"

    @property
    def tile_patches(self) -> int:
        """Patches of one tile (the tower's sequence, without a class token)."""
        return (self.image_size // self.patch) ** 2

    @property
    def patch_values(self) -> int:
        """Pixel values per patch, rounded down (a 384-pixel tile of 14-pixel patches has a 6-pixel margin)."""
        return self.channels * self.image_size**2 // self.tile_patches

    @property
    def linears(self) -> tuple[Linear, ...]:
        h, i = self.hidden, self.intermediate
        layer = tuple(Linear(n, h, h, True) for n in ("q_proj", "k_proj", "v_proj", "out_proj")) + (
            Linear("fc1", h, i, True),
            Linear("fc2", i, h, True),
        )
        return layer * self.depth + self.head_linears + self.connector

    @property
    def params(self) -> int:
        h = self.hidden
        norms = (2 * self.depth + 1) * 2 * h  # layer_norm1/2 per layer and post_layernorm: weight and bias
        conv = self.channels * self.patch**2 * h
        if self.class_token:  # class embedding, no conv bias, a position for the class token, pre_layrnorm
            embeddings = h + conv + (self.tile_patches + 1) * h + 2 * h
        else:
            embeddings = conv + h + self.tile_patches * h
        return embeddings + norms + sum(lin.params for lin in self.linears) + self.extra_params

    def tiles(self, patches: int) -> float:
        return patches / self.tile_patches

    def patches_at(self, max_pixels: int) -> int:
        """The patches the tower sees of one image at a cap (the family's `max_pixels`): Gemma-3's crops' squares
        (the image and its pan-and-scan crops), Idefics3's k × k tiles and the global image (one tile alone),
        LLaVA's crop, OneVision's largest pinpoint grid and the base crop."""
        if self.family == "idefics3":
            tiles = (math.isqrt(max_pixels) // self.image_size) ** 2
            tiles += 1 if tiles > 1 else 0
        else:
            tiles = max_pixels // self.image_size**2 + (1 if self.family == "llava_onevision" else 0)
        return max(1, tiles) * self.tile_patches

    def pixel_bytes(self, patches: int) -> float:
        """The batch's pixel values: fp32 tiles (the image processor's output), and Idefics3's pixel_attention_mask
        (int64, one per pixel: measured, the static phase of a SmolVLM step). Padding tiles (Idefics3's and OneVision's batches pad each sample to the most tiles) are not
        counted."""
        tile = 4 * self.channels * self.image_size**2 + (8 * self.image_size**2 if self.family == "idefics3" else 0)
        return self.tiles(patches) * tile

    def merged_bytes(self, patches: int, c: int) -> float:
        """The connector's output: one out_hidden feature per `patches_per_token` patches, in the compute dtype."""
        return c * self.out_hidden * patches / self.patches_per_token

    def through_tower(self, c: int) -> float:
        """Per tile, what `get_image_features` holds beside the tower through all its layers: Idefics3's real tiles
        in the compute dtype, its pixel mask's copy (the processor's int64 per pixel) and the patch mask (a bool per
        patch); OneVision's fp32
        concatenation of the crops."""
        values = self.channels * self.image_size**2
        if self.family == "idefics3":
            return c * values + 8 * self.image_size**2 + self.tile_patches
        if self.family == "llava_onevision":
            return 4 * values
        return 0.0

    def frozen_working_set(self, patches: int, c: int) -> float:
        """The frozen forward's peak beyond what existed before it: what `through_tower` holds, beside the larger of
        the patch embedding's moment — the c-byte copy of the pixel values beside the Conv2d's output (Idefics3:
        its two c-byte copies of the tiles, before the tower) — and a layer's two, each beside the embedding output
        (the encoder's input, held through every layer) and the layer's input: attention — layer_norm1's output,
        q, k, v, SDPA's output made contiguous and out_proj's (6·c·h) — and the MLP — the residual, layer_norm2's
        output and fc1's output with the activation's (`act_intermediates`). CLIP's class token adds one position
        per tile to the layers' sequence. Measured (PeakMemory, bf16): Gemma-3 1,304 / 2,048 / 4,608 B per patch
        at hidden 64 / 128 / 64 and intermediate 128 / 256 / 1024; LLaVA (CLIP) 1,304 / 2,570 / 6,682; SmolVLM
        2,397 / 3,421 / 5,981 (9 B per tile of bookkeeping not priced); OneVision 3,656 / 4,400 / 6,960."""
        h, tiles = c * self.hidden, self.tiles(patches)
        values = self.channels * self.image_size**2
        if self.family == "idefics3":  # the tiles already in the compute dtype: the Conv2d's output alone
            before, embed = 2 * c * values * tiles, patches * h
        else:
            before, embed = 0.0, patches * h + tiles * c * values
        held = h if self.depth > 1 else 0
        mlp = 3 * h + self.act_intermediates * c * self.intermediate
        sequence = patches + (tiles if self.class_token else 0)
        return max(before, tiles * self.through_tower(c) + max(embed, sequence * (held + max(7 * h, mlp))))

    def left(self, patches: int, c: int) -> float:
        """What the tower's forward leaves (the vision outputs the model returns with its output): the last hidden
        states (after the post LayerNorm), each recorded feature layer's hidden states, and the features —
        OneVision's packed: its grid's, a newline per grid row and the base crop's. The patches do not say the
        grid's shape, so the newlines are priced as for a one-column grid (one per `image_size / patch` grid
        features): an upper bound, exact for one crop and the base; unpadding only drops grid features."""
        sequence = patches + (self.tiles(patches) if self.class_token else 0)
        hidden = c * self.hidden * sequence * (1 + self.recorded)
        merged = self.merged_bytes(patches, c)
        if self.family == "llava_onevision":  # a newline per grid row: at most one per side of features beyond the base
            merged += c * self.out_hidden * max(0, patches - self.tile_patches) * self.patch / self.image_size
        return hidden + merged

    def outputs_kept(self, patches: int, c: int) -> tuple[float, float]:
        """(while the decoder's layers run, while its head and loss run). Gemma-3: the last hidden states and the
        projected features, kept by the vision outputs the forward holds until its decoder returns, the features
        alone beyond (`image_hidden_states`). The others: what the forward leaves (`left`), held with the model's
        output to the loss, and while the layers run the features' concatenated copy scattered into the input
        embeddings (`torch.cat(...).to(...)`)."""
        if self.family == "gemma3":
            last, merged = c * self.hidden * patches, self.merged_bytes(patches, c)
            return last + merged, merged
        left = self.left(patches, c)
        return left + self.merged_bytes(patches, c), left

    def trained_kept(
        self, patches: int, c: int, train: str, checkpointing: bool, r: int, drop: float, in_c: bool = False
    ) -> float:
        if train != "frozen":
            _untrained(train)
        return 0.0

    def trainable(self, train: str, r: int, c: int) -> list[tuple[int, int]]:
        if train != "frozen":
            _untrained(train)
        return []


def _untrained(train: str) -> None:
    from lowmem_ft.errors import UserError

    raise UserError(
        f"vision.train: {train} is not priced for a SigLIP / CLIP tower yet (the memory model knows what a trained "
        "Qwen-VL tower keeps, not a plain ViT's): set vision.train: frozen"
    )


def _fields(tower: ViTTower) -> dict[str, Any]:
    return {"tower_params": tower.params, "tower_linears": tower.linears, "vision": tower}


def _shape(v: dict[str, Any]) -> dict[str, Any]:
    return {"hidden": int(v["hidden_size"]), "intermediate": int(v["intermediate_size"]),
            "depth": int(v["num_hidden_layers"]), "heads": int(v["num_attention_heads"]),
            "channels": int(v["num_channels"]), "image_size": int(v["image_size"]), "patch": int(v["patch_size"]),
            "act_intermediates": mlp_intermediates(str(v.get("hidden_act")))}  # fmt: skip


def _pooling_head(v: dict[str, Any]) -> tuple[tuple[Linear, ...], int]:
    """SiglipMultiheadAttentionPoolingHead when vision_use_head: its nn.Linear layers (nn.MultiheadAttention's
    out_proj, fc1, fc2) and the rest (probe, the in-projection's weight and bias, a LayerNorm)."""
    if not v.get("vision_use_head", True):
        return (), 0
    h, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    head = (Linear("out_proj", h, h, True), Linear("fc1", h, inter, True), Linear("fc2", inter, h, True))
    return head, h + 3 * h * h + 3 * h + 2 * h


def gemma3_tower(vision: dict[str, Any], text_hidden: int, tokens_per_image: int = 256) -> dict[str, Any]:
    """Gemma-3's vision weights, loaded with the text model: run frozen when it trains on images, never run by text
    training. SigLIP and Gemma3MultiModalProjector (a vision × text `mm_input_projection_weight` and an RMSNorm of
    vision width), which average-pools each crop's (image / patch)² patches to mm_tokens_per_image."""
    v = {**SIGLIP_DEFAULTS, **vision}
    head, head_rest = _pooling_head(v)
    shape = _shape(v)
    patches = (shape["image_size"] // shape["patch"]) ** 2
    tower = ViTTower(
        "gemma3", **shape, out_hidden=text_hidden, patches_per_token=max(1, patches // int(tokens_per_image)),
        head_linears=head, extra_params=head_rest + shape["hidden"] * text_hidden + shape["hidden"],
    )  # fmt: skip
    return _fields(tower)


def idefics3_tower(config: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """An Idefics3 / SmolVLM config.json's vision tower and connector (SmolVLMVisionConfig has Idefics3's
    defaults)."""
    v = {**IDEFICS3_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    shape, scale = _shape(v), int(config.get("scale_factor", 2))
    tower = ViTTower(
        "idefics3", **shape, out_hidden=text_hidden, patches_per_token=scale * scale,
        connector=(Linear("proj", shape["hidden"] * scale * scale, text_hidden, False),),
    )  # fmt: skip
    return _fields(tower)


def _projector(config: dict[str, Any], hidden: int, text_hidden: int, layer: Any) -> dict[str, Any]:
    """LLaVA's two-layer projector over the selected feature layers (one, or a list concatenated), and how many
    hidden states those layers keep besides the last (`select_hidden_states` records only them)."""
    layers = [layer] if isinstance(layer, int) else list(layer)
    bias = bool(config.get("multimodal_projector_bias", True))
    return {"connector": (Linear("linear_1", hidden * len(layers), text_hidden, bias),
                          Linear("linear_2", text_hidden, text_hidden, bias)), "recorded": len(layers)}  # fmt: skip


def llava_tower(config: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """A LLaVA config.json's CLIP tower and two-layer projector."""
    v = {**CLIP_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    shape = _shape(v)
    projector = _projector(config, shape["hidden"], text_hidden, config.get("vision_feature_layer", -2))
    return _fields(ViTTower("llava", **shape, out_hidden=text_hidden, patches_per_token=1, **projector))


def llava_onevision_tower(config: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """A LLaVA-OneVision config.json: SiglipVisionModel (and its pooling head when vision_use_head), the projector
    and `image_newline`, one text-width vector."""
    v = {**SIGLIP_ONEVISION_DEFAULTS, **(config.get("vision_config") or {})}
    head, head_rest = _pooling_head(v)
    shape = _shape(v)
    projector = _projector(config, shape["hidden"], text_hidden, config.get("vision_feature_layer", -1))
    tower = ViTTower("llava_onevision", **shape, out_hidden=text_hidden, patches_per_token=1, head_linears=head,
                     extra_params=head_rest + text_hidden, **projector)  # fmt: skip
    return _fields(tower)


# model_type of the wrapper → (the tower reader, the model_type its text_config defaults to: transformers 5.24
# Idefics3Config / SmolVLMConfig / LlavaConfig sub_configs_defaults say llama, LlavaOnevisionConfig qwen2)
VIT_TOWERS = {"idefics3": (idefics3_tower, "llama"), "smolvlm": (idefics3_tower, "llama"),
              "llava": (llava_tower, "llama"), "llava_onevision": (llava_onevision_tower, "qwen2")}  # fmt: skip
