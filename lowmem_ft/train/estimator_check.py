"""Checking the memory model against reality: real training steps on a random-initialized model, measured exactly.

One grid point = build the model through `lowmem_ft.train.model.build_model` (the path `train` uses), install TRL's
fused LM head as `SFTTrainer` does, create the optimizer the way transformers' Trainer does for the recipe's
`optim`, run two optimizer steps (the second with gradient accumulation 2, so optimizer states and accumulated
gradients coexist with the activations, as in a steady-state step), and take `PeakMemory`'s exact peak of live
tensor bytes. The prediction is `lowmem_ft.memory.estimate` for the same setup with device overheads excluded.
Used by `scripts/validate_estimator.py` (the table) and `tests/train/test_estimator_check.py` (a tiny grid).
"""

from __future__ import annotations

import gc
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import estimate, setup_from_recipe
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.run import OPTIM_NAMES


@dataclass
class Point:
    arch: str
    adapter: str  # full | lora | qlora
    optimizer: str
    checkpointing: bool
    batch: int
    seq: int
    measured: int = 0
    predicted: float = 0.0

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def write_model(config: dict[str, Any], out: Path, seed: int = 0) -> Path:
    """A random-initialized model of `config` saved to `out` (bf16 safetensors, like a Hub checkpoint)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    model.save_pretrained(out)
    (out / "lowmem_config.json").write_text(json.dumps(config))
    return out


def recipe_for(model_dir: Path, p: Point):
    overrides = {
        "model": {"name_or_path": str(model_dir), "quantization": "nf4" if p.adapter == "qlora" else "none"},
        "adapter": {"kind": "full" if p.adapter == "full" else "lora", "r": 8},
        "optimizer": {"name": p.optimizer},
        "memory": {"gradient_checkpointing": p.checkpointing, "micro_batch_size": p.batch, "max_seq_len": p.seq},
    }
    return resolve(None, overrides)


def measure(model_dir: Path, p: Point, steps: int = 2) -> int:
    """Exact peak live tensor bytes over `steps` optimizer steps (accumulation 1, then 2)."""
    import torch
    from transformers import Trainer, TrainingArguments
    from trl.trainer.utils import add_fused_lm_head

    from lowmem_ft.train.measure import PeakMemory
    from lowmem_ft.train.model import build_model

    recipe = recipe_for(model_dir, p)
    torch.manual_seed(0)
    model = build_model(recipe)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer.__init__ does
    model.train()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim=OPTIM_NAMES[p.optimizer], use_cpu=True)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = cls([q for q in model.parameters() if q.requires_grad], **kwargs)
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    with PeakMemory() as pm:
        for step in range(steps):
            for _ in range(1 if step == 0 else 2):
                ids = torch.randint(0, vocab, (p.batch, p.seq), generator=gen)
                mask = torch.ones_like(ids)
                if p.batch > 1:
                    mask[-1, : p.seq // 4] = 0  # left padding on one row: the mask a padded batch carries
                out = model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True)
                loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)  # SFTTrainer.compute_loss
                loss.backward()
                del out, loss
            torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = pm.peak_bytes
    del model, base, optimizer, pm
    gc.collect()
    return peak


def predict(model_dir: Path, p: Point) -> float:
    recipe = recipe_for(model_dir, p)
    config = json.loads((model_dir / "lowmem_config.json").read_text())
    arch = Architecture.from_config(config, name=p.arch)
    # the CPU run has no device overheads; quantization/activations/loss terms take their CPU forms
    return estimate(arch, setup_from_recipe(recipe, device="cpu")).model_peak_bytes


def run_point(model_dir: Path, p: Point) -> Point:
    p.measured = measure(model_dir, p)
    p.predicted = predict(model_dir, p)
    return p
