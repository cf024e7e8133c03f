"""PiSSA and OLoRA adapters (`adapter.init`) kept true to the original base model, from the start to the final save.

The one idea: these inits move the adapter's principal part out of the base weights (W = W_res + s·B0·A0, peft
tuners/lora/layer.py `pissa_init`, `olora_init`), so the adapter being trained applies to the residual base only.
Three moments keep that straight, with peft's own machinery where it has it:
- start: the adapter as initialised (A0, B0) is saved to the run's initial_adapter/ before step 1 (`save_initial`);
- resume: the base is rebuilt as W − s·B0·A0 from that saved adapter (`rebuild_residual`), the arithmetic of peft's
  init, with no new decomposition: a new SVD need not give the same factors on other hardware or library versions
  (singular vectors' signs, a randomized SVD's draws), and it would cost the start-up peak again. Identical to the
  first start on an fp32 base; on a 16-bit base A0 and B0 are the adapter peft kept, rounded to the base's dtype;
- final save: peft's `save_pretrained(path_initial_model_for_weight_conversion=...)` writes ΔW = s(B·A − B0·A0) as a
  plain LoRA adapter on the original base, of rank 2r ([A; A0], [B, −B0]; alpha doubled so the scaling stays), so
  `generate --adapter`, `merge` and `train --adapter` on the original model give the trained model's outputs
  (`save_converted`). Checkpoints stay in the residual form, which is what resume continues.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from lowmem_ft.errors import UserError
from lowmem_ft.memory.adapter_init import decomposes
from lowmem_ft.recipe.schema import Recipe

log = logging.getLogger(__name__)


def rewrites_base(recipe: Recipe) -> bool:
    """Whether this run's adapter is initialised by a decomposition that rewrites the base weights."""
    a = recipe.adapter
    return a.kind == "lora" and not a.name_or_path and decomposes(a.init)


def build(recipe: Recipe, initial: Path, *, resuming: bool, is_main: bool):
    """The run's model: built as `build_model` does, then for PiSSA / OLoRA the initial adapter saved (a new run,
    main process) or the residual base rebuilt from it (a resumed run, every process)."""
    from lowmem_ft.train.model import build_model

    if not rewrites_base(recipe):
        return build_model(recipe)
    if not resuming:
        model = build_model(recipe)
        if is_main:
            save_initial(model, initial)
        return model
    if not (initial / "adapter_model.safetensors").is_file():
        raise UserError(
            f"--resume: this run's adapter.init is {recipe.adapter.init}, whose base weights are rebuilt from "
            f"{initial}, which is missing; start the run again without --resume"
        )
    model = build_model(replace(recipe, adapter=replace(recipe.adapter, init="default")))
    for config in model.peft_config.values():  # checkpoints keep saying what they are: the residual form
        config.init_lora_weights = recipe.adapter.init
    rebuild_residual(model, initial)
    return model


def save_initial(model, initial: Path) -> None:
    """The adapter as initialised, before any step: peft's files (its config says pissa / olora)."""
    model.save_pretrained(str(initial))
    log.info("adapter.init: the initial adapter is in %s (the final adapter is converted against it)", initial)


def rebuild_residual(model, initial: Path) -> None:
    """Each adapted base weight W becomes W − scaling·B0·A0 with the saved initial adapter's A0 and B0, in fp32
    and back to the weight's dtype, as peft's `pissa_init` / `olora_init` compute it."""
    import torch
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import transpose
    from safetensors.torch import load_file

    saved = load_file(str(initial / "adapter_model.safetensors"))
    done = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or f"{name}.lora_A.weight" not in saved:
                continue
            weight = module.get_base_layer().weight
            a0 = saved[f"{name}.lora_A.weight"].to(weight.device, torch.float32)
            b0 = saved[f"{name}.lora_B.weight"].to(weight.device, torch.float32)
            delta = transpose(module.scaling["default"] * b0 @ a0, module.fan_in_fan_out)
            weight.data = (weight.to(torch.float32) - delta).to(weight.dtype)
            done += 1
    if not done:
        raise UserError(f"--resume: {initial} holds no adapter matrices of this model's modules")
    log.info("adapter.init: the residual base rebuilt from %s (%d linears)", initial, done)


def save_converted(model, directory: Path, initial: Path) -> None:
    """Overwrite the adapter saved in `directory` with its conversion to plain LoRA on the original base."""
    import warnings

    with warnings.catch_warnings():
        # peft warns, when the conversion loads the initial adapter beside the trained one, to convert: this is it
        warnings.filterwarnings("ignore", message=r"(PiSSA|OLoRA) changes the base weights")
        model.save_pretrained(str(directory), path_initial_model_for_weight_conversion=str(initial))
