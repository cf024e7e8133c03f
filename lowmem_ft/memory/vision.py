"""The vision tower of a vision-language model, for the memory model: its weights, and what running it frozen
leaves alive. Pure arithmetic over config.json (no torch). Qwen2-VL's and Qwen3-VL's towers are variants of the one
below (`qwen2_vl_tower`, `qwen3_vl_tower`); Gemma-3's SigLIP tower and projector are counted by `gemma3_tower`.

Qwen2.5-VL (modeling_qwen2_5_vl.py, transformers 5.24): `model.visual` is a Conv3d patch embedding without bias
(channels × temporal_patch × patch² → hidden), `depth` blocks of RMSNorm → qkv (hidden → 3·hidden, bias) → proj
(bias) → RMSNorm → gate/up (hidden → intermediate, bias) → down (bias), and the patch merger: an RMSNorm of hidden,
Linear(4·hidden → 4·hidden) → GELU → Linear(4·hidden → out_hidden_size), both with bias. The count equals the model
transformers builds (tests/memory/test_vision.py).

Frozen (the only way lowmem-ft trains it): no parameter of the tower requires grad and pixel values do not either,
so its forward records no graph and every activation is freed as it goes; what stays is the merged image features
(image tokens × out_hidden in the compute dtype), scattered into the decoder's input embeddings, which the decoder
terms already count over text + image tokens. The pixel values themselves are part of the batch: rows of
channels × temporal_patch × patch² numbers (fp32 from the processor) per 14×14 patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowmem_ft.memory.blocks import Linear


@dataclass(frozen=True)
class VisionTower:
    """The shapes of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower."""

    hidden: int
    intermediate: int
    depth: int
    heads: int
    out_hidden: int
    patch_values: int  # numbers per patch row of pixel_values: channels × temporal patch × patch²
    merge: int  # spatial merge: merge² patches → one token

    @classmethod
    def qwen2_5_vl(cls, vision: dict[str, Any], text_hidden: int) -> VisionTower:
        patch, temporal = int(vision.get("patch_size", 14)), int(vision.get("temporal_patch_size", 2))
        channels = int(vision.get("in_channels", vision.get("in_chans", 3)))
        return cls(
            hidden=int(vision.get("hidden_size", 3584)),
            intermediate=int(vision.get("intermediate_size", 3420)),
            depth=int(vision.get("depth", 32)),
            heads=int(vision.get("num_heads", 16)),
            out_hidden=int(vision.get("out_hidden_size", text_hidden)),
            patch_values=channels * temporal * patch * patch,
            merge=int(vision.get("spatial_merge_size", 2)),
        )

    @property
    def linears(self) -> tuple[Linear, ...]:
        h, i, m = self.hidden, self.intermediate, self.hidden * self.merge**2
        block = (
            Linear("qkv", h, 3 * h, True),
            Linear("proj", h, h, True),
            Linear("gate_proj", h, i, True),
            Linear("up_proj", h, i, True),
            Linear("down_proj", i, h, True),
        )
        return block * self.depth + (Linear("0", m, m, True), Linear("2", m, self.out_hidden, True))

    @property
    def params(self) -> int:
        norms = 2 * self.depth * self.hidden + self.hidden  # norm1/norm2 per block, the merger's ln_q
        return self.patch_values * self.hidden + sum(lin.params for lin in self.linears) + norms

    def pixel_bytes(self, patches: int) -> int:
        """The batch's pixel_values: fp32 rows of `patch_values` per patch (the image processor's output)."""
        return 4 * patches * self.patch_values


def qwen2_5_vl_tower(vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """The Architecture fields of Qwen2.5-VL's tower: its parameters and nn.Linear layers (bitsandbytes quantizes
    them with the decoder's under 4-/8-bit loading)."""
    tower = VisionTower.qwen2_5_vl(vision, text_hidden)
    return {"tower_params": tower.params, "tower_linears": tower.linears, "vision": tower}


@dataclass(frozen=True)
class LayerNormTower(VisionTower):
    """Qwen2-VL's and Qwen3-VL's towers: Qwen2.5-VL's shape with LayerNorms (weight and bias) for its RMSNorms, a
    plain fc1 → act → fc2 MLP for its gated one, and Qwen3-VL's additions."""

    patch_bias: bool = False  # the patch Conv3d has a bias (Qwen3-VL)
    positions: int = 0  # learned position embeddings of the tower's width (Qwen3-VL's pos_embed)
    deepstack: int = 0  # extra mergers whose features go into the decoder's first layers (Qwen3-VL)

    @property
    def linears(self) -> tuple[Linear, ...]:
        h, i, m = self.hidden, self.intermediate, self.hidden * self.merge**2
        block = (Linear("qkv", h, 3 * h, True), Linear("proj", h, h, True), Linear("fc1", h, i, True),
                 Linear("fc2", i, h, True))  # fmt: skip
        merger = (Linear("0", m, m, True), Linear("2", m, self.out_hidden, True))
        return block * self.depth + merger * (1 + self.deepstack)

    @property
    def params(self) -> int:
        # LayerNorms (weight + bias): norm1/norm2 per block, the merger's over the tower's width, each deepstack
        # merger's over the merged merge² × width
        norms = 2 * (2 * self.depth * self.hidden + self.hidden + self.deepstack * self.hidden * self.merge**2)
        patch = self.patch_values * self.hidden + (self.hidden if self.patch_bias else 0)
        return patch + self.positions * self.hidden + sum(lin.params for lin in self.linears) + norms


def qwen2_vl_tower(vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """Qwen2-VL's tower (modeling_qwen2_vl.py Qwen2VisionTransformerPretrainedModel, transformers 5.24): the same
    Conv3d patches without bias and 2×2 merger as Qwen2.5-VL's, but LayerNorms (weight and bias; the merger's ln_q
    too), a plain fc1 → QuickGELU → fc2 MLP of `embed_dim × mlp_ratio`, and no window attention. Its vision_config
    names the tower's width `embed_dim` and the decoder's `hidden_size`."""
    patch, temporal = int(vision.get("patch_size", 14)), int(vision.get("temporal_patch_size", 2))
    channels = int(vision.get("in_channels", vision.get("in_chans", 3)))
    width = int(vision.get("embed_dim", 1280))
    tower = LayerNormTower(
        hidden=width,
        intermediate=int(width * float(vision.get("mlp_ratio", 4))),
        depth=int(vision.get("depth", 32)),
        heads=int(vision.get("num_heads", 16)),
        out_hidden=int(vision.get("hidden_size", text_hidden)),
        patch_values=channels * temporal * patch * patch,
        merge=int(vision.get("spatial_merge_size", 2)),
    )
    return {"tower_params": tower.params, "tower_linears": tower.linears, "vision": tower}


def qwen3_vl_tower(vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """Qwen3-VL's tower (modeling_qwen3_vl.py Qwen3VLVisionModel, transformers 5.24): Conv3d patches of 2×16×16 with
    a bias, learned position embeddings (`num_position_embeddings` × width, interpolated to the grid), blocks of
    LayerNorm → qkv → proj → LayerNorm → linear_fc1 → GELU → linear_fc2 (all with biases), the 2×2 merger (LayerNorm
    over the width, then fc1 / fc2), and one more merger per `deepstack_visual_indexes` entry (its LayerNorm over the
    merged 4 × width) whose features are added to the decoder's first layers' hidden states at the image tokens."""
    patch, temporal = int(vision.get("patch_size", 16)), int(vision.get("temporal_patch_size", 2))
    channels = int(vision.get("in_channels", 3))
    tower = LayerNormTower(
        hidden=int(vision.get("hidden_size", 1152)),
        intermediate=int(vision.get("intermediate_size", 4304)),
        depth=int(vision.get("depth", 27)),
        heads=int(vision.get("num_heads", 16)),
        out_hidden=int(vision.get("out_hidden_size", text_hidden)),
        patch_values=channels * temporal * patch * patch,
        merge=int(vision.get("spatial_merge_size", 2)),
        patch_bias=True,
        positions=int(vision.get("num_position_embeddings", 2304)),
        deepstack=len(vision.get("deepstack_visual_indexes", (8, 16, 24))),
    )
    return {"tower_params": tower.params, "tower_linears": tower.linears, "vision": tower}


# transformers' SiglipVisionConfig defaults (configuration_siglip.py): Gemma-3's vision_config names only some keys.
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_channels": 3,
                   "image_size": 224, "patch_size": 16, "vision_use_head": True}  # fmt: skip


def gemma3_tower(vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """Gemma-3's vision weights, loaded with the text model: run frozen when it trains on images (no graph, as
    Qwen2.5-VL's above), never run by text training. A SigLIP vision model
    (modeling_siglip.py: a patch Conv2d with bias, position embeddings, layers of LayerNorm → q/k/v/out_proj →
    LayerNorm → fc1/fc2, all with biases, a post LayerNorm, and the attention-pooling head when `vision_use_head`)
    and Gemma3MultiModalProjector (a vision × text `mm_input_projection_weight` and an RMSNorm of vision width)."""
    vision = {**SIGLIP_DEFAULTS, **vision}
    h, inter, layers = int(vision["hidden_size"]), int(vision["intermediate_size"]), int(vision["num_hidden_layers"])
    patch, channels = int(vision["patch_size"]), int(vision["num_channels"])
    patches = (int(vision["image_size"]) // patch) ** 2
    attention = [Linear(n, h, h, True) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    mlp = [Linear("fc1", h, inter, True), Linear("fc2", inter, h, True)]
    linears = (attention + mlp) * layers
    norms = (2 * layers + 1) * 2 * h  # layer_norm1/2 per layer, post_layernorm: LayerNorm weight and bias
    params = channels * patch * patch * h + h + patches * h + sum(lin.params for lin in linears) + norms
    if vision.get("vision_use_head", True):  # SiglipMultiheadAttentionPoolingHead: probe, nn.MultiheadAttention
        head_mlp = [Linear("fc1", h, inter, True), Linear("fc2", inter, h, True)]  # (its out_proj a Linear too)
        linears += (Linear("out_proj", h, h, True), *head_mlp)
        params += h + 3 * h * h + 3 * h + sum(lin.params for lin in linears[-3:]) + 2 * h
    params += h * text_hidden + h  # the projector
    return {"tower_params": params, "tower_linears": tuple(linears)}
