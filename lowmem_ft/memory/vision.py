"""The vision tower of a vision-language model, for the memory model: its weights, and what running it costs per
patch. Pure arithmetic over config.json (no torch). Qwen2-VL's and Qwen3-VL's towers are variants of Qwen2.5-VL's
(`LayerNormTower`: `qwen2_vl_tower`, `qwen3_vl_tower`); the plain-ViT towers (SigLIP, CLIP: Gemma-3, Idefics3 /
SmolVLM, LLaVA, LLaVA-OneVision) are one `ViTTower` in `lowmem_ft.memory.vision_towers`. Every tower answers the
same per-patch questions (`patches_at`, `pixel_bytes`, `frozen_working_set`, `outputs_kept`, `trained_kept`,
`trainable`), each checked against PeakMemory per family.

Qwen2.5-VL (modeling_qwen2_5_vl.py, transformers 5.24): `model.visual` is a Conv3d patch embedding without bias
(channels × temporal_patch × patch² → hidden), `depth` blocks of RMSNorm → qkv (hidden → 3·hidden, bias) → proj
(bias) → RMSNorm → gate/up (hidden → intermediate, bias) → down (bias), and the patch merger: an RMSNorm of hidden,
Linear(4·hidden → 4·hidden) → GELU → Linear(4·hidden → out_hidden_size), both with bias. The count equals the model
transformers builds (tests/memory/test_vision.py).

What running it costs is the tower's own description, per 14×14 patch (its pixel-value row), so the memory model's
terms (`lowmem_ft.memory.tower`) read any family's tower the same way. Read from modeling_qwen2_5_vl.py (transformers
5.24) and checked exactly against PeakMemory on the CPU (devkit/harness/vision.py, tests/vision/test_vision_memory.py):

- Frozen (`vision.train: frozen`): no tower parameter or input requires grad (`lowmem_ft.vision.tower` removes the
  input-grad hook transformers puts on its patch embedding), so every activation is freed as it goes.
  `frozen_working_set` is the largest moment: the bf16 copy of the pixel values (`get_image_features`), the
  rotary cos/sin in fp32 and the position and window indices alive through all blocks, beside the larger of a
  block's rotary moment (`apply_rotary_pos_emb_vision` upcasts q and k to fp32) and its MLP moment.
- What it leaves while the decoder runs (`outputs_kept`): the last block's hidden states and the merged features
  (`BaseModelOutputWithPooling`, returned with the decoder's output up to the loss), and inside the decoder the
  features' `torch.cat` copy scattered into the input embeddings.
- The batch's pixel values: rows of channels × temporal_patch × patch² numbers (fp32 from the processor) per patch.
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
    patch: int = 14  # a patch's side in pixels

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
            patch=patch,
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

    def patches_at(self, max_pixels: int) -> int:
        """The most patches one image makes under a resolution cap: its tokens (sides in multiples of
        patch × merge) times merge² (`lowmem_ft.vision.families.QwenVLImages.max_tokens`)."""
        return max_pixels // (self.patch * self.merge) ** 2 * self.merge**2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def pixel_bytes(self, patches: int) -> int:
        """The batch's pixel_values: fp32 rows of `patch_values` per patch (the image processor's output)."""
        return 4 * patches * self.patch_values

    def merged_bytes(self, patches: int, c: int) -> float:
        """The merger's output: one out_hidden feature per merge² patches, in the compute dtype."""
        return c * self.out_hidden * patches / self.merge**2

    def frozen_working_set(self, patches: int, c: int) -> float:
        """The frozen forward's peak beyond what existed before it (SDPA or flash attention: linear in patches).

        Through all blocks: the c-byte copy of the pixel values (`get_image_features`: `pixel_values.type(dtype)`),
        the rotary cos and sin (fp32, head_dim each, permuted to the window order), the (h, w) position ids
        (2 int64) and the window index (one int64 per merge² patches). Beside them the larger of two block moments,
        with the block's input held by the tower's loop: the rotary moment — norm1's output, qkv (3h) and, as
        `apply_rotary_pos_emb_vision` builds k's rotation, q and k upcast to fp32 (none at fp32), q's rotated
        result, k's two products and its sum (4 h-sized fp32 each) — and the MLP moment: the block input, the
        residual after attention, norm2's output, act(gate), up and their product (3 intermediate-sized).
        Measured (PeakMemory, bf16, 16–1,024 patches, one or two images): 4,802 / 5,410 / 6,978 / 9,794 B per patch
        at hidden 64 / 80 / 128 / 128 and intermediate 128 / 128 / 256 / 1024, each equal to this sum."""
        h = self.hidden
        upcasts = 0 if c == 4 else 2
        rotary = 5 * c * h + 4 * h * (upcasts + 4)
        return patches * (self.through_blocks(c) + max(rotary, self.mlp_moment(c)))

    def through_blocks(self, c: int) -> float:
        """Per patch, what stays alive through all blocks (`frozen_working_set`): the pixel copy, the fp32 rotary
        cos/sin, the (h, w) position ids (2 int64) and Qwen2.5-VL's window index (one int64 per merge² patches)."""
        return c * self.patch_values + 2 * 4 * self.head_dim + 2 * 8 + 8 / self.merge**2

    def mlp_moment(self, c: int) -> float:
        """Per patch, a block's MLP moment: the block input, the residual after attention, norm2's output and
        three intermediate-sized tensors (Qwen2.5-VL's act(gate), up and their product)."""
        return 3 * c * self.hidden + 3 * c * self.intermediate

    def block_kept(self, c: int, train: str, r: int, drop: float, first: bool = False, in_c: bool = False) -> float:
        """Per patch, what one trained block keeps for backward (autograd's saved tensors, read from the block's
        code): each RMSNorm its fp32 input and rsqrt (not the first block's norm1 under LoRA: its input needs no
        grad); SDPA q and k after the rotary, the qkv output (v is a view of it), the output and the fp32
        logsumexp per head; the MLP act(gate), up and gate's output. LoRA: each adapted linear its fp32 input
        copy, dropout noise (`drop` B per element) and lora_A's output (peft, as `linears.peft_lora_input_bytes`);
        full: the linears' inputs (gate and up share norm2's output) and each norm's normalized input, which its
        trained weight's product keeps. `in_c`: LoRA's weights in the compute dtype (`Setup.lora_in_compute_dtype`):
        no cast, c-byte dropped copies and lora_A outputs; without dropout lora_A keeps its input itself, norm1's
        and norm2's outputs and the MLP product (the attention output is kept already) — as
        `linears.peft_lora_input_bytes`, read from peft, not traced on a tower."""
        h, i = self.hidden, self.intermediate
        norms = (4 * h + 4) * (1 if first and train == "lora" else 2)
        if train == "full":  # a trained norm weight: `weight * x` keeps x (c·h) for the weight's gradient
            norms += 2 * c * h
        attention = 6 * c * h + 4 * self.heads
        mlp = 3 * c * i
        b = c if in_c else 4
        lora = 4 * ((b + drop) * h + b * r) + (b + drop) * i + b * r
        if in_c and not drop:
            lora = 2 * c * h + c * i + 5 * b * r
        linears = lora if train == "lora" else 3 * c * h + c * i
        return norms + attention + mlp + linears

    def merger_kept(self, c: int, train: str, r: int, drop: float, in_c: bool = False) -> float:
        """Per patch, what the trained merger keeps: ln_q's fp32 input and rsqrt, GELU's input, the two linears'
        inputs (LoRA: fp32 copies, noise and lora_A outputs, one merged token per merge² patches), the index.
        `in_c`: as `block_kept`'s (without dropout lora_A keeps ln_q's output and GELU's output themselves)."""
        h, m = self.hidden, self.merge**2
        b = c if in_c else 4
        linears = 2 * ((b + drop) * h + b * r / m) if train == "lora" else 3 * c * h  # full: ln_q's weight too
        if train == "lora" and in_c and not drop:
            linears = 2 * (c * h + b * r / m)
        return 4 * h + 4 / m + c * h + linears + 8 / m

    def trained_kept(
        self, patches: int, c: int, train: str, checkpointing: bool, r: int, drop: float, in_c: bool = False
    ) -> float:
        """A trained tower's saved tensors through the decoder and the backward: every block's (`block_kept`) or,
        checkpointed (its blocks are transformers' GradientCheckpointingLayer), each block's input; the merger's; the
        fp32 rotary cos/sin the rotary's products save; full: the patch embedding's input (the pixel copy)."""
        if train == "frozen":
            return 0.0
        blocks = (
            self.depth * c * self.hidden
            if checkpointing
            else self.block_kept(c, train, r, drop, True, in_c)
            + (self.depth - 1) * self.block_kept(c, train, r, drop, False, in_c)
        )
        conv = c * self.patch_values if train == "full" else 0
        return patches * (blocks + self.merger_kept(c, train, r, drop, in_c) + 2 * 4 * self.head_dim + conv)

    def trainable(self, train: str, r: int, c: int) -> list[tuple[int, int]]:
        """(numel, bytes per element) of the tower's trainable tensors: LoRA's A and B (fp32) per linear, or every
        parameter in the compute dtype."""
        if train == "lora":
            return [t for lin in self.linears for t in ((r * lin.in_features, 4), (lin.out_features * r, 4))]
        if train == "full":
            out = [(self.patch_values * self.hidden, c)]
            for lin in self.linears:
                out += [(lin.in_features * lin.out_features, c)] + ([(lin.out_features, c)] if lin.bias else [])
            return out + [(self.hidden, c)] * (2 * self.depth + 1)
        return []

    def outputs_kept(self, patches: int, c: int) -> tuple[float, float]:
        """(while the decoder's layers run, while its head and loss run): the last hidden states (c·hidden per
        patch) and the merged features, plus inside the decoder their `torch.cat` copy (Qwen2_5_VLModel.forward)."""
        last, merged = c * self.hidden * patches, self.merged_bytes(patches, c)
        return last + 2 * merged, last + merged


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
    deepstack_early: int = 0  # of them, those made before the last block (alive through its moments)
    act_intermediates: int = 3  # intermediate-sized tensors at the MLP moment: QuickGELU 3, gelu_pytorch_tanh 2

    def through_blocks(self, c: int) -> float:
        """Qwen2.5-VL's without the window index (no window attention); Qwen3-VL's position embeddings add the
        bilinear interpolation's 4 int64 indices and 4 fp32 weights per patch and `pos_embeds` itself, fp32
        (bf16 rows × fp32 weights, summed; the forward keeps the name through its blocks), and the deepstack
        features made before the last block (one c·out_hidden per merge² patches each)."""
        pixel_and_rotary = c * self.patch_values + 2 * 4 * self.head_dim + 2 * 8
        positions = 4 * 8 + 4 * 4 + 4 * self.hidden if self.positions else 0
        return pixel_and_rotary + positions + self.deepstack_early * self.merged_bytes(1, c)

    def mlp_moment(self, c: int) -> float:
        """fc1 → act → fc2: the block input, the residual, norm2's output and fc1's output with the activation's
        tensors (QuickGELU's `x * sigmoid(1.702 * x)`: 3 at its product; one-kernel GELU: 2)."""
        return 3 * c * self.hidden + self.act_intermediates * c * self.intermediate

    def outputs_kept(self, patches: int, c: int) -> tuple[float, float]:
        """Qwen2.5-VL's, plus Qwen3-VL's deepstack features (one c·out_hidden per merge² patches each): the tower's
        list and, in the decoder's layers, their concatenation per level (`Qwen3VLModel.forward`)."""
        in_layers, at_head = super().outputs_kept(patches, c)
        deepstack = self.deepstack * self.merged_bytes(patches, c)
        return in_layers + 2 * deepstack, at_head + deepstack

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
        patch=patch,
        act_intermediates=mlp_intermediates(vision.get("hidden_act", "quick_gelu")),
    )
    return {"tower_params": tower.params, "tower_linears": tower.linears, "vision": tower}


def mlp_intermediates(act: str) -> int:
    """Intermediate-sized tensors alive at an fc1 → act → fc2 MLP's moment (transformers' activations.py):
    QuickGELU's `x * sigmoid(1.702 * x)` holds fc1's output, the sigmoid and the product; a one-kernel activation
    (GELU, tanh GELU, SiLU) fc1's output and its own. Measured with `frozen_working_set` (tests/vision)."""
    return 3 if act == "quick_gelu" else 2


def qwen3_vl_tower(vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """Qwen3-VL's tower (modeling_qwen3_vl.py Qwen3VLVisionModel, transformers 5.24): Conv3d patches of 2×16×16 with
    a bias, learned position embeddings (`num_position_embeddings` × width, interpolated to the grid), blocks of
    LayerNorm → qkv → proj → LayerNorm → linear_fc1 → GELU → linear_fc2 (all with biases), the 2×2 merger (LayerNorm
    over the width, then fc1 / fc2), and one more merger per `deepstack_visual_indexes` entry (its LayerNorm over the
    merged 4 × width) whose features are added to the decoder's first layers' hidden states at the image tokens."""
    patch, temporal = int(vision.get("patch_size", 16)), int(vision.get("temporal_patch_size", 2))
    channels = int(vision.get("in_channels", 3))
    depth, indexes = int(vision.get("depth", 27)), list(vision.get("deepstack_visual_indexes", (8, 16, 24)))
    tower = LayerNormTower(
        hidden=int(vision.get("hidden_size", 1152)),
        intermediate=int(vision.get("intermediate_size", 4304)),
        depth=depth,
        heads=int(vision.get("num_heads", 16)),
        out_hidden=int(vision.get("out_hidden_size", text_hidden)),
        patch_values=channels * temporal * patch * patch,
        merge=int(vision.get("spatial_merge_size", 2)),
        patch_bias=True,
        positions=int(vision.get("num_position_embeddings", 2304)),
        deepstack=len(indexes),
        deepstack_early=sum(1 for k in indexes if k < depth - 1),
        patch=patch,
        act_intermediates=mlp_intermediates(vision.get("hidden_act", "gelu_pytorch_tanh")),
    )
    return {"tower_params": tower.params, "tower_linears": tower.linears, "vision": tower}
