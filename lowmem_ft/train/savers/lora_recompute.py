"""LoRA branches recomputed in token tiles (`memory.recompute_lora`): what peft's adapters keep per token, gone.

The one idea: peft's LoRA layer computes `lora_B(lora_A(dropout(x.to(fp32)))) * scaling` beside the frozen base
layer, and autograd keeps, for every adapted linear on its own, the dropout's noise or mask, the fp32 dropped copy of
the input and lora_A's output — (4 + 4 + mask) B per input element: 82 KB per token for the attention projections
of one Llama-3.1-8B layer, 14 GB of one recomputed layer at 100k tokens. None of it is needed before backward:
here each LoRA branch runs in token tiles under torch's non-reentrant `checkpoint`, which keeps only the branch's
input (the c-byte tensor the base layer reads, shared by q/k/v) and recomputes the cast, the dropout (same masks:
the RNG state is restored) and lora_A in backward, one tile at a time. The base layer runs as peft runs it.

Not in peft 0.21 (its LoRA layers have no recompute option) nor in the other libraries on our stack; Unsloth's fused
LoRA kernels save less for the same reason but are not a library we can call. So this wraps peft's own modules: the
layer's instance `forward` is replaced by one that calls `base_layer` and then the same vanilla-LoRA arithmetic as
peft's `Linear.forward` / bnb `Linear4bit.forward` (result dtype handling included); adapters peft computes
differently (DoRA and other variants, mixed-adapter batches, merged or disabled adapters) take peft's own path.
With the tiled MLP on, the MLP's linears are left alone: they already run inside the MLP's tiles.
"""

from __future__ import annotations

import logging
import types

import torch

from lowmem_ft.train.savers.tiles import tiled_forward

log = logging.getLogger(__name__)


def _branch(layer, adapter: str, cast: bool):
    """peft's vanilla LoRA update of one adapter: input cast to the adapter's dtype (unless bnb under autocast),
    dropout, A, B, scaling."""
    lora_A, lora_B = layer.lora_A[adapter], layer.lora_B[adapter]
    dropout, scaling = layer.lora_dropout[adapter], layer.scaling[adapter]

    def branch(x: torch.Tensor) -> torch.Tensor:
        if cast:
            x = layer._cast_input_dtype(x, lora_A.weight.dtype)
        return lora_B(lora_A(dropout(x))) * scaling

    return branch


def recomputed_forward(layer, tile_tokens: int):
    """A forward for peft LoRA `layer` whose adapter branches keep only their input for backward."""
    peft_forward = types.MethodType(type(layer).forward, layer)
    # peft's plain Linear adds the fp32 update to the base result and casts the sum once; bnb's Linear4bit /
    # Linear8bitLt cast each update first, and under autocast neither cast (tuners/lora/layer.py Linear.forward,
    # tuners/lora/bnb.py): both are kept as peft has them.
    bnb = type(layer).__module__.endswith(".bnb")

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if layer.disable_adapters or layer.merged or kwargs.get("adapter_names") is not None:
            return peft_forward(x, *args, **kwargs)
        if any(a in layer.lora_variant for a in active):
            return peft_forward(x, *args, **kwargs)
        result = layer.base_layer(x, *args, **kwargs)
        dtype = result.dtype
        convert = not (bnb and torch.is_autocast_enabled())
        for a in active:
            update = tiled_forward(_branch(layer, a, convert), tile_tokens)(x)
            result = result + (update.to(dtype) if bnb and convert else update)
        return result if bnb else result.to(dtype)

    return forward


def recompute_lora(model, tile_tokens: int, skip_mlp: bool) -> int:
    """Wrap every peft LoRA linear of `model` (outside the decoder MLPs when `skip_mlp`); returns how many."""
    from peft.tuners.lora import LoraLayer

    count, kept = 0, {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or not hasattr(module, "base_layer"):
            continue
        if skip_mlp and ".mlp." in f".{name}.":
            continue
        if not isinstance(module.base_layer, torch.nn.Linear):  # Linear4bit / Linear8bitLt subclass nn.Linear
            kept.setdefault(type(module.base_layer).__name__, []).append(name)
            continue
        if getattr(module, "_lowmem_recompute", False):
            continue
        module.forward = recomputed_forward(module, tile_tokens)
        module._lowmem_recompute = True
        count += 1
    for kind, names in kept.items():  # one line per layer type, not one per layer of every block
        log.warning(
            "memory.recompute_lora: %d LoRA layers on %s keep peft's forward (%s%s)",
            len(names), kind, ", ".join(names[:3]), ", ..." if len(names) > 3 else "",
        )  # fmt: skip
    return count
