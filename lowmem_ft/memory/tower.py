"""A vision-language step's image terms: the batch's pixel values, the vision tower's forward, and what its outputs
and the decoder's image inputs keep alive — read from the tower's own description (`Architecture.vision`: a Qwen-VL
`lowmem_ft.memory.vision.VisionTower` or a plain-ViT `lowmem_ft.memory.vision_towers.ViTTower`), so a family adds
its tower there and these terms read it unchanged.

The one idea: the tower runs first, on the whole micro batch's patches (`Setup.patches`), before the decoder's first
layer; so its working set is a forward moment of its own beside the static state and the input embeddings, and only
what it hands on (its outputs, and under checkpointing the embedding output it scattered into) lives on into the
decoder's moments. Every term is 0 for a text step (no tower, or no patches).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.linears import dropout_mask_bytes
from lowmem_ft.memory.records import DTYPE_BYTES, Component, Setup

PIXELS = "pixel values (fp32)"


def has_images(arch: Architecture, s: Setup) -> bool:
    return arch.vision is not None and s.patches > 0


def pixel_values_bytes(arch: Architecture, s: Setup) -> float:
    """The pixel values of the micro batches held through a step: as the batch tensors are (transformers' Trainer
    fetches the accumulation window's micro batches before its first forward, each already on the device; on the
    CPU the loader's next one too: `static.BATCH`). Measured exactly: a tiny Qwen2.5-VL step's static phase was
    2 × 768 patches × 4,704 B over the text model's (+288 B: image_grid_thw, 3 int64 per image, not counted)."""
    if not has_images(arch, s):
        return 0.0
    held = s.gradient_accumulation + (1 if s.device == "cpu" else 0)
    return held * arch.vision.pixel_bytes(s.patches)


def pixel_component(arch: Architecture, s: Setup) -> Component | None:
    n = pixel_values_bytes(arch, s)
    if not n:
        return None
    held = s.gradient_accumulation + (1 if s.device == "cpu" else 0)
    return Component(PIXELS, n, "static", f"{held} micro batches × {s.patches} patches × "
                     f"{arch.vision.patch_values} fp32 (the image processor's pixel_values)")  # fmt: skip


def tower_copy_component(arch: Architecture, s: Setup) -> Component | None:
    """`vision.train: full` beside a LoRA decoder: peft's `modules_to_save` trains a copy of the tower beside the
    frozen original (peft utils/other.py ModulesToSaveWrapper: `copy.deepcopy(self.original_module)`), in the
    compute dtype (full training refuses 4-/8-bit loading: `lowmem_ft.vision.tower.modules_to_save`)."""
    if arch.vision is None or s.vision_train != "full" or s.adapter != "lora":
        return None
    return Component("vision tower, trainable copy", DTYPE_BYTES[s.compute_dtype] * arch.vision.params, "static",
                     "peft modules_to_save: a trainable copy of the tower beside the frozen one")  # fmt: skip


@dataclass(frozen=True)
class TowerMoments:
    """Bytes above the static state (each 0 for a text step)."""

    working_set: float  # the tower's forward, beside the input embeddings (the forward's first moment)
    in_layers: float  # alive while the decoder's layers and final norm run
    at_head: float  # alive while the head and the loss run
    kept: float  # alive from the embeddings to the end of the backward


def tower_moments(arch: Architecture, s: Setup) -> TowerMoments:
    """The tower's moments for this step. `kept`: under checkpointing with LoRA, transformers'
    `enable_input_require_grads` makes the embedding output a leaf that requires grad, and the autograd graph holds
    it (AccumulateGrad) beside the copy `masked_scatter` makes with the image features, which the first checkpointed
    layer keeps: one more c·hidden per token through forward and backward, only when the batch has images (text
    batches use the embedding output itself). Measured exactly on the tiny Qwen2.5-VL: 33,282 B at 258 tokens × 64
    (33,024 + the 258-byte scatter mask)."""
    if not has_images(arch, s):
        return TowerMoments(0.0, 0.0, 0.0, 0.0)
    c, v, p = DTYPE_BYTES[s.compute_dtype], arch.vision, s.patches
    embeds = c * arch.hidden_size * s.tokens
    in_layers, at_head = v.outputs_kept(p, c)
    leaf = embeds + s.tokens if s.gradient_checkpointing and s.adapter == "lora" else 0.0
    drop = dropout_mask_bytes(s)
    trained = v.trained_kept(p, c, s.vision_train, s.gradient_checkpointing, s.lora_r, drop, s.lora_in_compute_dtype)
    return TowerMoments(embeds + v.frozen_working_set(p, c) + trained, in_layers, at_head, leaf + trained)


def tower_components(arch: Architecture, s: Setup) -> list[Component]:
    """The tower's named components for the plan's table (their bytes are the moments' largest)."""
    m = tower_moments(arch, s)
    if not m.working_set:
        return []
    return [
        Component("vision tower forward (frozen)", m.working_set, "forward/backward",
                  f"{s.patches} patches: the tower's largest moment (memory.vision, memory.vision_towers; measured)"),
        Component("vision tower outputs", m.in_layers + m.kept, "forward/backward",
                  "last hidden states + merged features (+ the embedding leaf under checkpointing)"),
    ]  # fmt: skip
