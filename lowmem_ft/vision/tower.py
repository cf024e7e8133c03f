"""How the vision tower trains (`vision.train`: frozen | lora | full), set on the model the build path makes
(`lowmem_ft.train.model`): which tower parameters require grad, where peft puts the tower's adapters, and that a
frozen tower records no autograd graph.

The one idea: the tower is whatever the model holds beside its language model (`beside_language_model`: Qwen2.5-VL's
`model.visual`), so nothing here names a family's modules; the memory model prices the same three ways
(`lowmem_ft.memory.vision`).

Why `freeze_tower_inputs` exists: under gradient checkpointing with frozen embeddings the build path calls
transformers' `enable_input_require_grads` (checkpointed layers need an input that requires grad), and transformers
5.24 hooks every sub-model's input embeddings, the tower's patch embedding included
(modeling_utils.py `enable_input_require_grads`: `Qwen2_5_VisionTransformerPretrainedModel._input_embed_layer =
"patch_embed"`). The "frozen" tower then records a graph from its first layer on and keeps every block's activations
through the backward, which computes gradients nobody uses. Measured on the tiny Qwen2.5-VL (PeakMemory, 768 patches,
checkpointing on): 1,268 B per patch still alive when the decoder starts, against the 192 of the tower's outputs.
The tower needs no such hook in any mode (its LoRA weights, or its own parameters, make its blocks' outputs require
grad), so it is removed.
"""

from __future__ import annotations

from typing import Any

TowerTraining = str  # "frozen" | "lora" | "full" (`lowmem_ft.recipe.schema.VisionTrain`)


def towers(model) -> list[str]:
    """Modules loaded beside the language model: the siblings of `get_decoder()` when it is nested in a wrapper
    (Qwen2_5_VLModel: model.visual beside model.language_model; Gemma3ForConditionalGeneration: model.vision_tower
    and model.multi_modal_projector). Empty for a plain causal LM, whose decoder is `model` beside only the head."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    name = next((n for n, m in model.named_modules() if m is decoder), "")
    if "." not in name:
        return []
    parent = name.rsplit(".", 1)[0]
    return [f"{parent}.{child}" for child, m in model.get_submodule(parent).named_children() if m is not decoder]


def set_tower_training(model, train: TowerTraining) -> None:
    """After the build path froze the base and set checkpointing (`prepare_for_training`): the tower's parameters
    require grad only for `full`, and no tower input is made to require grad (`freeze_tower_inputs`). A tower that
    never runs (Gemma-3, trained as text) stays frozen whatever `train` says."""
    from lowmem_ft.vision.families import VISION_FAMILIES

    if getattr(model.config, "model_type", "") not in VISION_FAMILIES:
        train = "frozen"
    for name in towers(model):
        model.get_submodule(name).requires_grad_(train == "full")
    freeze_tower_inputs(model)


def freeze_tower_inputs(model) -> None:
    """Remove the hooks transformers' `enable_input_require_grads` put on the towers' input embeddings. Called
    after the last caller of `enable_input_require_grads` on the build path (peft's `get_peft_model` calls it again
    under checkpointing: peft_model.py) and after the guard's mid-run checkpointing: each call adds a hook and keeps
    only its own handles, so the hooks are found on the module, by the function transformers registers."""
    for name in towers(model):
        tower = model.get_submodule(name)
        get = getattr(tower, "get_input_embeddings", None)
        try:
            embed = get() if get is not None else None
        except (NotImplementedError, AttributeError):
            embed = None
        if embed is None:
            continue
        for key, hook in list(embed._forward_hooks.items()):
            if "enable_input_require_grads" in getattr(hook, "__qualname__", ""):
                del embed._forward_hooks[key]
                embed._forward_hooks_with_kwargs.pop(key, None)
                embed._forward_hooks_always_called.pop(key, None)


def modules_to_save(model, train: TowerTraining) -> list[str] | None:
    """peft's modules_to_save for a fully trained tower beside a LoRA decoder: peft freezes every base parameter, and
    a module it saves is a trainable copy beside the frozen original (`ModulesToSaveWrapper`), saved with the
    adapter. Priced so by the memory model (the tower's weights once more). None otherwise."""
    if train != "full" or getattr(model.config, "model_type", "") not in _trained_on_images():
        return None
    from lowmem_ft.errors import UserError

    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    if quantized:
        raise UserError(
            "vision.train full trains the tower's own weights, which 4-/8-bit loading quantizes: set "
            "model.quantization=none (or vision.train lora)"
        )
    return [name.rsplit(".", 1)[-1] for name in towers(model)]


def _trained_on_images() -> set[str]:
    from lowmem_ft.vision.families import VISION_FAMILIES

    return set(VISION_FAMILIES)


def lora_targets(model, targets: Any, exclude: str | None, train: TowerTraining) -> tuple[Any, str | None]:
    """peft's (target_modules, exclude_modules) with the tower's adapters: for `lora`, every nn.Linear of the
    towers (attention qkv and proj, the MLP's gate/up/down, the merger's two) beside the decoder's targets, and no
    tower excluded; otherwise as given (the towers excluded by `attach_adapter`; a fully trained tower is a module
    peft saves, `modules_to_save`)."""
    if train != "lora":
        return targets, exclude
    import torch

    names = towers(model)
    tower_linears = [
        n for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and any(n.startswith(f"{t}.") for t in names)
    ]  # fmt: skip
    if targets == "all-linear":  # peft's all-linear: every nn.Linear but the output layer, the towers' too
        return targets, None
    decoder = [
        n for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not any(n.startswith(f"{t}.") for t in names)
        and any(n == t or n.endswith(f".{t}") for t in targets)
    ]  # fmt: skip
    if not decoder:  # the recipe's names match nothing in the decoder: peft refuses them as given
        return targets, exclude
    return [*decoder, *tower_linears], None
