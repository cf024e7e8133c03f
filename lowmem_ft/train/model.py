"""Building what trains: tokenizer, base model in the recipe's storage, lean k-bit preparation, LoRA adapters.

The one idea: QLoRA preparation without peft's `prepare_model_for_kbit_training`, which casts every 16-bit
parameter (embeddings and lm_head included) to fp32 — ~4 GB more on a 7B model with a 152k vocabulary.
Here the base stays in its storage dtype, only the LoRA weights are fp32 (peft's `autocast_adapter_dtype`), and
inputs require grad so checkpointed layers still backpropagate into the adapters.

Loading says what went wrong in one line — the path only when the path is the problem — and falls back to the
attention implementation the family supports when transformers refuses the recipe's (Gemma-2: eager, no SDPA).

The same functions serve `train`, the estimator's accuracy harness, `generate` and `merge`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import Recipe

log = logging.getLogger(__name__)


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _first_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def _load_error(name: str, exc: Exception) -> str:
    """One line naming why `name` did not load: the path only when the path is the problem."""
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"model directory {path} has no config.json; pass the directory that holds the model's files"
        if "does not recognize this architecture" in str(exc):
            return (
                f"model {path}: transformers does not know its model_type ({_first_line(exc)}); upgrade transformers, "
                "or pass --trust-remote-code if the repository ships its own modeling code"
            )
        weights = [*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.safetensors.index.json")]
        if not weights:
            return f"model directory {path} has a config.json but no weights (*.safetensors or *.bin)"
        return f"model {path} did not load ({_first_line(exc)})"
    kind = "is a file, not a model directory" if path.exists() else "is not a local directory"
    return (
        f"model '{name}' {kind} and could not be loaded from the Hub ({_first_line(exc)}); "
        "check the hub id or pass a local directory with config.json"
    )


def load_config(recipe: Recipe):
    """The model's transformers config, or a UserError saying why it cannot be had."""
    from transformers import AutoConfig

    from lowmem_ft import native

    name = recipe.model.name_or_path
    if not name:
        raise UserError("no model given; pass --model HUB_ID_OR_PATH")
    conversion = native.checkpoint_conversion(name)
    if conversion is not None:  # its own code is never run: the native model it maps onto
        return native.transformers_config(name, conversion)
    try:
        with native.remote_code_errors(name, recipe.model.trust_remote_code):
            return AutoConfig.from_pretrained(name, trust_remote_code=recipe.model.trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise UserError(
                f"model '{name}' needs its own code to load; rerun with --trust-remote-code if you trust the repository"
            ) from None
        raise UserError(_load_error(name, exc)) from None
    except OSError as exc:
        raise UserError(_load_error(name, exc)) from None


def load_tokenizer(recipe: Recipe):
    """The recipe model's tokenizer, loaded as the data pipeline loads it (pad token = EOS when it has none,
    `data.chat_template` applied)."""
    from lowmem_ft.data.tokenize import load_tokenizer as load

    return load(recipe.model.name_or_path, recipe.model.trust_remote_code, recipe.data.chat_template or None)


def quantization_config(recipe: Recipe):
    """transformers `BitsAndBytesConfig` for the recipe's storage, or None for 16-bit weights."""
    from transformers import BitsAndBytesConfig

    m = recipe.model
    if m.quantization == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=m.double_quant,
            bnb_4bit_compute_dtype=torch_dtype(m.compute_dtype),
            bnb_4bit_quant_storage=torch_dtype(m.compute_dtype),
        )
    if m.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def device_map(device: str | None = None) -> dict[str, Any] | None:
    """One process, one device: the local CUDA device when there is one (or `device` says so), else the CPU."""
    import os

    import torch

    if device == "cpu":
        return None
    if device == "cuda" or torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", 0))}
    return None


def attention(recipe: Recipe, config) -> str:
    """The attention implementation to load with: the recipe's, or what the family supports when transformers
    refuses it (Gemma-2 has no SDPA: softcapped attention logits; Gemma-3's multimodal checkpoints no flash
    attention), said once in the log. The memory model makes the same choice (`Architecture.attention_for`), so the
    plan counts the implementation that runs."""
    from lowmem_ft.memory.arch import Architecture

    requested = recipe.model.attn_implementation
    try:  # the whole config: a multimodal wrapper (Gemma-3) refuses what its text model alone would take
        arch = Architecture.from_config(config.to_dict())
    except UserError:  # not a shape the memory model describes: transformers decides
        return requested
    used, why = arch.attention_for(requested)
    if why:
        log.warning("model.attn_implementation=%s: %s", requested, why)
    return used


# transformers 5.25 turns Hub kernels on by default (`from_pretrained(use_kernels=None)` → True where the `kernels`
# package is installed, and 5.25 requires it) and kernelizes again on every `train()` / `eval()`, which puts each
# kernel layer's class forward back and drops the per-module forwards the memory savers install (measured: tiled
# norms silently off: a long-context CPU point measured 46 % over its prediction). The kernels also download code from the Hub and
# change which tensors a layer keeps. The memory model is of the torch implementations, so every load says False
# (5.24 and earlier default to it). Read in transformers 5.25.0 modeling_utils.py (from_pretrained, train).
HUB_KERNELS_OFF = {"use_kernels": False}


def auto_class(config):
    """The transformers Auto class that builds this config: AutoModelForImageTextToText for a vision-language
    checkpoint trained on images (Qwen2.5-VL, whose config AutoModelForCausalLM refuses), else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from lowmem_ft.vision.families import VISION_FAMILIES

    return AutoModelForImageTextToText if config.model_type in VISION_FAMILIES else AutoModelForCausalLM


def load_model(recipe: Recipe, device: str | None = None):
    """The base model in the recipe's storage (NF4 / int8 / 16-bit), on this process's device (or `device`)."""
    from safetensors import SafetensorError

    from lowmem_ft import native

    config = load_config(recipe)  # a clear error before any weight is read
    auto = auto_class(config)
    m = recipe.model
    kwargs: dict[str, Any] = dict(
        dtype=torch_dtype(m.compute_dtype),
        attn_implementation=attention(recipe, config),
        trust_remote_code=m.trust_remote_code,
        device_map=device_map(device),
        **HUB_KERNELS_OFF,
    )
    bnb = quantization_config(recipe)
    if bnb is not None:
        kwargs["quantization_config"] = bnb
    conversion = native.checkpoint_conversion(m.name_or_path)
    if conversion is not None:
        kwargs["trust_remote_code"] = False
        try:
            return native.load_model(m.name_or_path, conversion, config, **kwargs)
        except (OSError, ValueError, SafetensorError) as exc:
            raise UserError(_load_error(m.name_or_path, exc)) from None
    try:
        with native.remote_code_errors(m.name_or_path, m.trust_remote_code):
            return auto.from_pretrained(m.name_or_path, **kwargs)
    except ImportError as exc:
        if kwargs["attn_implementation"] != "flash_attention_2":
            raise UserError(f"cannot load '{m.name_or_path}': {_first_line(exc)}") from None
        # flash-attn missing here: SDPA (or the family's fallback) keeps the same memory profile (no s² scores)
        sdpa = attention(replace(recipe, model=replace(m, attn_implementation="sdpa")), config)
        log.warning("model.attn_implementation=flash_attention_2: %s; loading with %s", _first_line(exc), sdpa)
        return auto.from_pretrained(m.name_or_path, **{**kwargs, "attn_implementation": sdpa})
    except (OSError, ValueError, SafetensorError) as exc:
        if "attention implementation" in str(exc):  # refused by a family not in arch.NO_SDPA: say which
            raise UserError(
                f"model '{m.name_or_path}' refuses model.attn_implementation={kwargs['attn_implementation']} "
                f"({_first_line(exc)}); set --set model.attn_implementation=eager"
            ) from None
        raise UserError(_load_error(m.name_or_path, exc)) from None


def _offload(recipe: Recipe) -> bool:
    """memory.activation_offloading, where there is a device to offload from.

    transformers pins the host copies (`save_on_cpu(pin_memory=True)`), which a CPU-only torch cannot allocate
    ("pin_memory=True requires a CUDA or other accelerator backend"); there the activations already live in host
    memory, so there is nothing to move. TRL's `activation_offloading` is not used: it fails without an
    accelerator too (`current_accelerator().type` on None), offloads every saved tensor rather than the
    checkpointed layer inputs, and wraps only the trainer's step, not this build path the estimator harness uses.
    """
    import torch

    if not recipe.memory.activation_offloading:
        return False
    if not torch.accelerator.is_available():
        log.warning("memory.activation_offloading: no accelerator, activations already live in host memory")
        return False
    return True


def prepare_for_training(model, recipe: Recipe):
    """Lean k-bit preparation: freeze the base in its storage dtype, checkpointing without the fp32 upcast."""
    full = recipe.adapter.kind == "full"
    for param in model.parameters():
        param.requires_grad_(full)
    from lowmem_ft.vision.tower import set_tower_training

    for name in beside_language_model(model):  # a vision tower: text never runs it, so it gets no gradient
        model.get_submodule(name).requires_grad_(False)
    if recipe.memory.gradient_checkpointing:
        # transformers 5.x: activation_checkpointing_enable(offload=True) keeps the checkpointed layer inputs in
        # pinned host memory (torch's save_on_cpu) — the recipe's memory.activation_offloading.
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}, offload=_offload(recipe)
        )
        # Frozen embeddings give checkpointed layers inputs without grad; make them require it so the
        # recomputed layers backpropagate into the adapters (what peft's helper does, minus the upcast).
        if not full:
            model.enable_input_require_grads()
    set_tower_training(model, recipe.vision.train)  # a vision tower: frozen, LoRA or full (lowmem_ft.vision.tower)
    model.config.use_cache = False
    return model


def adapter_modules(model, target_modules: list[str]) -> list[str]:
    """The recipe's `target_modules` on this model: fused projections stand in for their parts (Phi-3: q/k/v_proj →
    qkv_proj, gate/up_proj → gate_up_proj), as the memory model counts them (`Architecture.lora_targets`). Names
    outside the decoder block (a custom module) pass through for peft to match or refuse."""
    from lowmem_ft.memory.arch import FUSED_PROJECTIONS, Architecture

    try:
        arch = Architecture.from_config(model.config.get_text_config().to_dict())
    except UserError:
        return list(target_modules)
    names = arch.adapter_modules(list(target_modules))
    fused_parts = {p for fused, parts in FUSED_PROJECTIONS.items() if fused in arch.linear_names for p in parts}
    others = [n for n in target_modules if n not in arch.linear_names and n not in fused_parts]
    if arch.moe and arch.moe.adapted_parameters(list(target_modules)):
        # peft would turn these names into LoRA on the fused expert stacks / the router (target_parameters), which
        # refuses lora_dropout != 0 (lora.ParamWrapper) and which the memory model does not count: the experts stay
        # frozen, as on the families where the names match nothing (Mixtral's gate_proj)
        reached = sorted(set(arch.moe.adapted_parameters(list(target_modules))))
        log.warning(
            "adapter.target_modules %s: on this mixture of experts peft would adapt the %s parameters "
            "(target_parameters), which lowmem-ft does not train; LoRA goes on %s only, the experts stay frozen",
            list(target_modules),
            " and ".join(reached),
            ", ".join(names),
        )
        others = [n for n in others if n not in arch.moe.peft_names and n != "all-linear"]
    added = [n for n in names if n not in target_modules]
    if added:
        log.info("adapter.target_modules %s: this model fuses them into %s", list(target_modules), ", ".join(added))
    return [*names, *others]


def beside_language_model(model) -> list[str]:
    """Modules loaded beside the language model that text training never runs (`lowmem_ft.vision.tower.towers`)."""
    from lowmem_ft.vision.tower import towers

    return towers(model)


def attach_adapter(model, recipe: Recipe):
    """LoRA adapters with fp32 weights (peft's autocast_adapter_dtype), or the model itself for full fine-tuning.

    Only the language model is adapted: the recipes' names (q/k/v_proj) and all-linear also match a vision tower's
    layers, whose adapters would get no gradient from text, be saved, and be missing from the plan's count
    (`Architecture.lora_targets` counts the decoder's linears). peft's `exclude_modules` (a regex, saved in
    adapter_config.json so loading and merging skip them too) keeps them out."""
    if recipe.adapter.kind == "full":
        return model
    from peft import LoraConfig, get_peft_model
    from peft.utils.error import NoMatchingPeftModuleError

    from lowmem_ft.memory.arch import MOE_FAMILIES
    from lowmem_ft.vision.tower import lora_targets as tower_lora_targets
    from lowmem_ft.vision.tower import modules_to_save as tower_modules_to_save

    a = recipe.adapter
    moe = getattr(model.config.get_text_config(), "model_type", "") in MOE_FAMILIES  # all-linear reaches experts
    targets: Any = (
        "all-linear" if a.target_modules == ["all-linear"] and not moe else adapter_modules(model, a.target_modules)
    )
    beside = beside_language_model(model)
    exclude = rf"({'|'.join(re.escape(n) for n in beside)})(\..*)?" if beside else None
    targets, exclude = tower_lora_targets(model, targets, exclude, recipe.vision.train)  # vision.train lora
    config = LoraConfig(
        r=a.r,
        lora_alpha=a.alpha,
        lora_dropout=a.dropout,
        use_rslora=a.use_rslora,
        use_dora=a.use_dora,
        init_lora_weights=True if a.init == "default" else a.init,  # peft's True: B = 0
        target_modules=targets,
        exclude_modules=exclude,
        modules_to_save=tower_modules_to_save(model, recipe.vision.train),  # vision.train full
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as exc:
        if isinstance(exc, NoMatchingPeftModuleError) or "Target modules" in str(exc) or "not found" in str(exc):
            language_model = f" of its language model (not {', '.join(beside)})" if beside else " of this model"
            names = sorted(
                {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n and not re.fullmatch(exclude or "", n)}
            )
            raise UserError(
                f"adapter.target_modules {a.target_modules} match no module{language_model}; "
                f"its module names include {', '.join(names[:20])}"
            ) from None
        raise


def load_adapter(model, recipe: Recipe):
    """The existing LoRA adapter the recipe continues (`adapter.name_or_path`, located and checked by
    `lowmem_ft.adapter`), trainable, its weights in fp32 as a new adapter's are (peft's autocast_adapter_dtype)."""
    from peft import PeftModel

    from lowmem_ft.adapter import locate

    saved = locate(recipe.adapter.name_or_path)
    misfit = saved.misfit_model(model)
    if misfit:
        raise UserError(f"--adapter {saved.source} does not fit {recipe.model.name_or_path}: {misfit}")
    return PeftModel.from_pretrained(model, str(saved.path), is_trainable=True, autocast_adapter_dtype=True)


def build_model(recipe: Recipe):
    """Base model + preparation + adapters, ready for the trainer: the single build path of every command."""
    from lowmem_ft.train.savers.apply import apply_memory_savers
    from lowmem_ft.vision.tower import freeze_tower_inputs

    model = load_model(recipe)
    model = prepare_for_training(model, recipe)
    model = load_adapter(model, recipe) if recipe.adapter.name_or_path else attach_adapter(model, recipe)
    apply_memory_savers(model, recipe)  # the recipe's long-context savers, last
    freeze_tower_inputs(model)  # a vision tower's input needs no grad, whoever hooked it (lowmem_ft.vision.tower)
    return model


def trainable_summary(model) -> dict[str, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_params": trainable, "total_params": total}


def keep_adapters_fp32(model, recipe: Recipe) -> None:
    """Undo TRL's bf16 cast of trainable weights on quantized models (SFTTrainer.__init__, "When using QLoRA").

    lowmem-ft keeps LoRA weights in fp32, as peft's autocast_adapter_dtype makes them: updates of size lr × grad
    can fall below bf16's resolution, and the memory model counts adapters at 4 bytes per parameter.
    """
    import torch

    if recipe.adapter.kind != "lora":
        return
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()


def forget_bnb_overrides(model) -> None:
    """Drop this model's embeddings from bitsandbytes' process-wide `GlobalOptimManager`: transformers' Trainer
    registers every nn.Embedding there (32-bit optimizer states, trainer.py `create_optimizer`) and nothing
    unregisters them, so each finished run's embedding would stay alive in a process that goes on (generate after
    train, tests, the GPU check)."""
    import sys

    optim = sys.modules.get("bitsandbytes.optim")
    if optim is None:
        return
    mine = {id(m) for m in model.modules()}
    manager = optim.GlobalOptimManager.get_instance()
    manager.module_weight_config_triple = [t for t in manager.module_weight_config_triple if id(t[0]) not in mine]
