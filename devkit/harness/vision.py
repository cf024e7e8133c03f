"""Checking the memory model of a vision-language step against reality: real training steps of a tiny zoo
vision-language checkpoint (Qwen2.5-VL, Qwen2-VL, Qwen3-VL, Gemma-3) on image chats, measured exactly per phase.

One point = the zoo checkpoint built through `lowmem_ft.train.model.build_model` (the path `train` uses), the vision
tower frozen or trained (`vision.train`), TRL's fused LM head installed as `SFTTrainer` does, and micro batches made
the way a run makes them: image-chat rows tokenized by `lowmem_ft.vision` with their image tokens, collated by its
`VisionCollator` through the checkpoint's own image processor (PIL) at the point's resolution cap. The steps are
`lowmem_ft.train.measure.peak.STEPS` (accumulation 1, then 2), so the steady-state micro-step 2.2 runs beside the
optimizer states and the accumulated gradients. The prediction is `lowmem_ft.memory.estimate.phase_peak_bytes` for
the same setup, with the batch's image patches. Used by `devkit/bench/estimator_vision.py` and
`tests/vision/test_vision_memory.py`.
"""

from __future__ import annotations

import gc
import json
import tempfile
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

# image sizes (width, height) of the points: a photo's 4:3 and a portrait 3:4, both resized by the cap
SIZES = ((448, 336), (336, 448))


@dataclass
class VisionPoint:
    train: str  # vision.train: frozen | lora | full
    checkpointing: bool
    images: int  # images per sample
    max_pixels: int  # the resolution cap
    adapter: str = "lora"  # the decoder's: lora | full
    optimizer: str = "adamw_torch"
    patches: int = 0  # pixel-value rows of the measured micro batch (filled by `run_point`)
    tokens: int = 0  # its sequence length
    phases: dict[str, tuple[int, int]] = field(default_factory=dict)
    predicted_phases: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return (f"tower {self.train}, ckpt {'on' if self.checkpointing else 'off'}, {self.images} image(s) ≤ "
                f"{self.max_pixels:,} px")  # fmt: skip


def recipe_for(model_dir: str, p: VisionPoint, data: Path | None = None):
    from lowmem_ft.recipe.load import resolve

    overrides: dict[str, Any] = {
        "model": {"name_or_path": str(model_dir), "quantization": "none"},
        "adapter": {"kind": p.adapter, "r": 8},
        "optimizer": {"name": p.optimizer},
        "memory": {"gradient_checkpointing": p.checkpointing, "micro_batch_size": 1, "max_seq_len": 4096,
                   "gradient_accumulation": 1},
        "vision": {"max_pixels": p.max_pixels, "train": p.train},
    }  # fmt: skip
    if data is not None:
        overrides["data"] = {"path": str(data)}
    return resolve(None, overrides)


def write_data(folder: Path, images: int) -> Path:
    """One image chat with `images` images (`SIZES`, in turn), as a user's JSONL beside its image folder."""
    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    names = []
    for k in range(images):
        size = SIZES[k % len(SIZES)]
        Image.new("RGB", size, (40 * k + 20, 90, 160)).save(folder / "img" / f"{k}.png")
        names.append(f"img/{k}.png")
    row = {
        "messages": [
            {"role": "user", "content": [*({"type": "image"} for _ in names), {"type": "text", "text": "Describe."}]},
            {"role": "assistant", "content": "A flat blue picture with nothing else in it."},
        ],
        "images": names,
    }
    path = folder / "vlm.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def _batches(collator, record, n: int):
    """`n` micro batches of `record`, each collated one ahead (accelerate's loader on the CPU: the memory model's
    batch term counts it, `lowmem_ft.memory.estimate.BATCH_BYTES_PER_TOKEN`)."""
    ahead = [collator([record])]
    for _ in range(n):
        ahead.append(collator([record]))
        yield ahead.pop(0)


def _loss(model, batch: dict[str, Any]):
    """SFTTrainer's loss through TRL's fused LM head (`lowmem_ft.train.measure.peak.fused_head_loss`), with the
    batch's pixel values."""
    out = model(**batch, fused_lm_head=True)
    return -out.log_probs.sum() / out.label_mask.sum().clamp(min=1), out


def measure(model_dir: str, p: VisionPoint) -> dict[str, tuple[int, int]]:
    """Exact live tensor bytes per phase over `STEPS` (phase label → (peak within it, live at its end)); fills
    `p.patches` and `p.tokens` from the batch that ran."""
    import torch
    from transformers import TrainingArguments
    from trl.trainer.utils import add_fused_lm_head

    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.train.args import OPTIM_NAMES
    from lowmem_ft.train.measure.peak import STEPS, PeakMemory, measured_step, trainer_optimizer
    from lowmem_ft.train.model import build_model
    from lowmem_ft.vision.setup import _tokenizer, vision_of

    folder = Path(tempfile.mkdtemp())
    recipe = recipe_for(model_dir, p, write_data(folder, p.images))
    vision = vision_of(recipe)
    tokenizer = _tokenizer(recipe)
    record = vision.load(recipe, tokenizer).records[0]
    record = {"input_ids": record["input_ids"], "labels": record["labels"], "image_files": record["images"],
              "image_tokens": record["image_tokens"]}  # fmt: skip
    collator = vision.collator(recipe, tokenizer)
    torch.manual_seed(0)
    model = build_model(recipe)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
    model.train()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim=OPTIM_NAMES[p.optimizer], use_cpu=True)
    optimizer = trainer_optimizer(model, args)
    trainable = [q for q in model.parameters() if q.requires_grad]
    with PeakMemory(roots=[model, optimizer.state]) as pm:
        pm.mark("static")
        batches = _batches(collator, record, len(STEPS))
        measured_step(pm, batches, partial(_loss, model), optimizer, trainable)
        phases = {m.label: (m.peak_bytes, m.live_bytes) for m in pm.marks}
        phases["peak"] = (pm.peak_bytes, pm.live_bytes)
    one = collator([record])
    # the tower's patches: pixel-value rows (Qwen-VL), or crops × (image / patch)² (SigLIP's square crops)
    p.patches = _patches(load_architecture(model_dir).vision, one)
    p.tokens = int(one["input_ids"].shape[1])
    del model, base, optimizer, trainable, pm, batches
    gc.collect()
    return phases


def _patches(vision, batch) -> int:
    """The tower's patches in a batch: pixel-value rows (Qwen-VL), or the real tiles / crops × their patches (a ViT:
    Idefics3's and OneVision's batches pad each sample with all-zero tiles, which the model drops)."""
    if "pixel_values" not in batch:
        return 0
    pixels = batch["pixel_values"]
    if not hasattr(vision, "tile_patches"):
        return int(pixels.numel()) // vision.patch_values
    tiles = pixels.reshape(-1, vision.channels * vision.image_size**2)
    return int((tiles != 0).any(dim=1).sum()) * vision.tile_patches


def predict(model_dir: str, p: VisionPoint) -> dict[str, float]:
    """`phase_peak_bytes` per phase for the batch that ran (1 row × `p.tokens`, `p.patches` patch rows), in the
    steady state (gradients and states alive), and the static phase."""
    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.estimate import estimate, phase_peak_bytes

    recipe = recipe_for(model_dir, p)
    arch = load_architecture(model_dir)
    s = replace(setup_from_recipe(recipe, device="cpu"), max_seq_len=p.tokens, image_patches=p.patches)
    out = {phase: phase_peak_bytes(arch, s, phase) for phase in ("forward", "backward", "optimizer step")}
    return {"static": estimate(arch, s).phases["static"], **out}


def run_point(model_dir: str, p: VisionPoint) -> VisionPoint:
    p.phases = measure(model_dir, p)
    p.predicted_phases = predict(model_dir, p)
    return p
