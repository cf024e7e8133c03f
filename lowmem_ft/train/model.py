"""Building what trains: tokenizer, base model in the recipe's storage, lean k-bit preparation, LoRA adapters.

The one idea: QLoRA preparation without peft's `prepare_model_for_kbit_training`, which casts every 16-bit
parameter (embeddings and lm_head included) to fp32 — ~4 GB more on a 7B model with a 152k vocabulary.
Here the base stays in its storage dtype, only the LoRA weights are fp32 (peft's `autocast_adapter_dtype`), and
inputs require grad so checkpointed layers still backpropagate into the adapters.

The same functions serve `train`, the estimator's accuracy harness and `generate`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import Recipe

log = logging.getLogger(__name__)


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _hub_hint(name: str, exc: Exception) -> str:
    kind = "is not a local directory" if not Path(name).exists() else "is a local path without a usable model"
    return (
        f"model '{name}' {kind} and could not be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
        "check the hub id or pass a local directory with config.json"
    )


def load_config(recipe: Recipe):
    """The model's transformers config, or a UserError saying why it cannot be had."""
    from transformers import AutoConfig

    name = recipe.model.name_or_path
    if not name:
        raise UserError("no model given; pass --model HUB_ID_OR_PATH")
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=recipe.model.trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise UserError(
                f"model '{name}' needs its own code to load; rerun with --trust-remote-code if you trust the repository"
            ) from None
        raise UserError(_hub_hint(name, exc)) from None
    except OSError as exc:
        raise UserError(_hub_hint(name, exc)) from None


def load_tokenizer(recipe: Recipe):
    """The recipe model's tokenizer, loaded as the data pipeline loads it (pad token = EOS when it has none)."""
    from lowmem_ft.data.tokenize import load_tokenizer as load

    return load(recipe.model.name_or_path, recipe.model.trust_remote_code)


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


def load_model(recipe: Recipe, device: str | None = None):
    """The base model in the recipe's storage (NF4 / int8 / 16-bit), on this process's device (or `device`)."""
    from transformers import AutoModelForCausalLM

    load_config(recipe)  # a clear error before any weight is read
    m = recipe.model
    kwargs: dict[str, Any] = dict(
        dtype=torch_dtype(m.compute_dtype),
        attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
        device_map=device_map(device),
    )
    bnb = quantization_config(recipe)
    if bnb is not None:
        kwargs["quantization_config"] = bnb
    try:
        return AutoModelForCausalLM.from_pretrained(m.name_or_path, **kwargs)
    except ImportError as exc:
        raise UserError(
            f"cannot load '{m.name_or_path}' with attn_implementation={m.attn_implementation}: {exc}"
        ) from None
    except (OSError, ValueError) as exc:
        raise UserError(_hub_hint(m.name_or_path, exc)) from None


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
    model.config.use_cache = False
    return model


def attach_adapter(model, recipe: Recipe):
    """LoRA adapters with fp32 weights (peft's autocast_adapter_dtype), or the model itself for full fine-tuning."""
    if recipe.adapter.kind == "full":
        return model
    from peft import LoraConfig, get_peft_model

    a = recipe.adapter
    targets: Any = "all-linear" if a.target_modules == ["all-linear"] else list(a.target_modules)
    config = LoraConfig(
        r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    try:
        return get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as exc:
        if "Target modules" in str(exc) or "not found" in str(exc):
            names = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n})
            raise UserError(
                f"adapter.target_modules {a.target_modules} match no module of this model; "
                f"its module names include {', '.join(names[:20])}"
            ) from None
        raise


def build_model(recipe: Recipe):
    """Base model + preparation + adapters, ready for the trainer: the single build path of every command."""
    from lowmem_ft.train.savers import apply_memory_savers

    model = load_model(recipe)
    model = prepare_for_training(model, recipe)
    model = attach_adapter(model, recipe)
    apply_memory_savers(model, recipe)  # memory.tiled_mlp, recompute_lora, embeddings_on_host
    return model


def trainable_summary(model) -> dict[str, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_params": trainable, "total_params": total}
