"""Evaluation forwards during training (no autograd): the MLP's tensors in flight and the peak of one
evaluation batch. Generation after training is `lowmem_ft.memory.inference`.
"""

from __future__ import annotations

from dataclasses import replace

from lowmem_ft.memory.activations import attention_mask_bytes, head_saved_bytes, layer_activation_bytes
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import (
    BATCH_BYTES_PER_TOKEN,
)
from lowmem_ft.memory.experts import moe_eval_bytes
from lowmem_ft.memory.linears import lora_linears
from lowmem_ft.memory.loss import loss_bytes
from lowmem_ft.memory.overheads import device_overheads, overhead_bytes
from lowmem_ft.memory.records import DTYPE_BYTES, Setup, effective_setup, mlp_tile_tokens
from lowmem_ft.memory.static import _static_components


def eval_mlp_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, the MLP's tensors in flight without autograd (evaluation), at its peak.

    Gated: act(gate) is alive while `up_proj` runs; a plain up_proj leaves act(gate), up and their product (3·c·i). A
    LoRA `up_proj` (peft lora/layer.py Linear.forward: `result + lora_B(lora_A(x)) * scaling`) holds its base output
    (c·i) and lora_B's fp32 output and its scaled copy (4 + 4 B) beside act(gate): (2·c + 8)·i. Measured with
    PeakMemory on Qwen2MLP (i 16384, under no_grad): 12.0 / 6.0 B per i-element (plain, fp32 / bf16), 16.0 / 12.06
    (LoRA on gate/up/down). The fused gate_up_proj (Phi-3) doubles the LoRA part (read from the code, unmeasured);
    a plain (non-gated) MLP holds its up output and the activation (2·c·i), or a LoRA up_proj's three tensors.
    """
    c, i = DTYPE_BYTES[s.compute_dtype], arch.intermediate_size
    if arch.moe:
        return moe_eval_bytes(arch, s)
    adapted = {lin.name for lin in lora_linears(arch, s)} if s.adapter == "lora" else set()
    if "gate_up_proj" in adapted:
        return (2 * c + 16) * i
    if arch.mlp == "gated":
        return (2 * c + 8) * i if "up_proj" in adapted else 3 * c * i
    return (c + 8) * i if adapted & {"up_proj", "fc1", "c_fc"} else 2 * c * i


def eval_peak_bytes(arch: Architecture, s: Setup, batch: int) -> float:
    """Peak of one evaluation forward during training, overheads included: the eval batch size's memory.

    Evaluation runs under `torch.no_grad()` between optimizer steps, so the static memory is the training one minus
    the gradients (transformers' Trainer zeroes them with `set_to_none`), and nothing is kept for backward: the
    working set is one layer's tensors in flight (bounded by what that layer saves when training — the same
    tensors, created and freed in turn), the residual stream and layer output, the final norm and loss input, and
    the forward of the loss (TRL's fused head also runs in evaluation). The layer and the loss peak one after the
    other, not together; checked against exact CPU measurements of real runs' evaluations (`lowmem_ft.train.exact`).
    """
    s, _ = effective_setup(arch, s)
    train, _, _ = _static_components(arch, s)  # what `estimate` counts as static
    static = sum(x.bytes for x in train if x.phase == "static" and x.name != "gradients")
    # an evaluation batch's labelled positions are not known: every position (`loss_tokens` None)
    es = replace(
        s,
        micro_batch_size=batch,
        gradient_checkpointing=False,
        activation_offloading=False,
        lora_dropout=0.0,
        loss_tokens=None,
    )
    c, t = DTYPE_BYTES[s.compute_dtype], es.tokens
    loss_fwd, _, _ = loss_bytes(arch, es)
    dequant = c * max(x.in_features * x.out_features for x in arch.linears) if s.quantization != "none" else 0.0
    # Without autograd nothing outlives its layer: the peak is one layer's tensors in flight (beside the dequantized
    # weight), or later the loss's forward beside the final norm and loss input — never both (measured with the
    # exact CPU count of real runs' evaluations, lowmem_ft.train.exact: summing them over-predicted by up to 25 %).
    # With tiled_mlp the MLP's tiles run one after another: one tile's MLP tensors at a time.
    mlp = eval_mlp_bytes(arch, es) * (mlp_tile_tokens(arch, es) if es.tiled_mlp else t)
    layer = max(layer_activation_bytes(arch, es) * t, mlp) + 2 * c * arch.hidden_size * t
    transient = max(layer + dequant, head_saved_bytes(arch, es) * t + loss_fwd) + attention_mask_bytes(arch, es)
    transient += BATCH_BYTES_PER_TOKEN * t * (2 if s.device == "cpu" else 1)  # the eval batch (+ the loader's next)
    return static + transient + overhead_bytes(device_overheads(s, transient))
