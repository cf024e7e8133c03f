"""The checkpointed backward's layer moment with peft's own LoRA branches: the end of the recomputed forward.

The one idea: torch's non-reentrant checkpoint (torch/utils/checkpoint.py, early stop on by default) recomputes a
layer when the layer's backward first unpacks a saved tensor, and stops as soon as the last saved tensor exists —
the lora_A output of the layer's last adapted linear (the MLP's down projection). That moment is the backward's
layer peak: everything the layer saves (`activations.layer_activation_bytes`) exists again, beside the unkept
copies of that linear's input, a few hidden-sized tensors of the recomputed forward and the gradients the backward
holds when it asks for the recompute; the head's saved tensors are freed by then (its backward came first). The
layer's own backward frees saved tensors faster than it makes gradients, so it stays below this moment.
Traced at full size and at small shapes (calibration.RECOMPUTE_END_*); the other checkpointed setups (full
fine-tuning, DoRA, LoRA recompute, the tiled MLP, mixtures of experts) keep their measured terms
(`transients.backward_transient_bytes`).
"""

from __future__ import annotations

from lowmem_ft.memory.activations import head_saved_bytes
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import (
    RECOMPUTE_END_BESIDE,
    RECOMPUTE_END_FP32,
    RECOMPUTE_END_GRAD_FP32,
    TOKEN_BOOKKEEPING_BYTES,
)
from lowmem_ft.memory.linears import dropout_mask_bytes, lora_bytes, lora_linears
from lowmem_ft.memory.records import DTYPE_BYTES, Setup
from lowmem_ft.memory.savers import RECOMPUTE_LORA, TILED_MLP

FUSED = {"gate_up_proj", "qkv_proj", "c_attn", "query_key_value"}  # one linear for several projections


def ends_recomputed_forward(arch: Architecture, s: Setup) -> bool:
    """Whether the checkpointed backward's layer moment is `recompute_end_bytes`' (traced): peft's own LoRA branches
    on a dense block with a norm before the attention and one before the MLP, without DoRA, LoRA recompute or the
    tiled MLP (their moments were measured apart). Gemma-2/3's sandwich norms (a norm after the MLP, whose saved
    tensors come last) and the parallel blocks move the recompute's end elsewhere: traced on gemma-2-9b cut to one
    layer (24 / 40 GB plans) this form under-predicted by 17.5 / 10.4 kB/token, so they keep the measured term; so
    do fused projections (Phi-3's gate_up_proj and qkv_proj, whose output side is a moment of its own, not traced
    here: this form took Phi-3-mini-4k's long 24 GB backward from -1.0 % to -1.7 %)."""
    lins = lora_linears(arch, s)
    if not (s.gradient_checkpointing and s.adapter == "lora" and lins) or any(lin.name in FUSED for lin in lins):
        return False
    return arch.norms_per_layer == 2 and not (arch.moe or s.use_dora or TILED_MLP.on(s) or RECOMPUTE_LORA.on(s))


def _kept_lora_input(s: Setup) -> float:
    """Per input element, what peft's LoRA branch keeps of its input: the fp32 cast (c B where the LoRA weights run
    in the compute dtype: the dropped copy, or without dropout the input itself) and the dropout mask
    (`linears.peft_lora_input_bytes`)."""
    return (lora_bytes(s) if s.lora_in_compute_dtype else RECOMPUTE_END_FP32) + dropout_mask_bytes(s)


def recompute_end_bytes(arch: Architecture, s: Setup) -> float:
    """The recomputed forward's moments beyond what the layer saves, the larger (calibration.RECOMPUTE_END_*).

    Its end: the widest-input adapted linear's input (c bytes) and peft's fp32 cast of it (`_cast_input_dtype`;
    none in fp32), less whichever of them lora_A keeps (without dropout it keeps the cast), beside RECOMPUTE_END_BESIDE
    c-byte hidden-sized tensors (the base output, the MLP's input, the residual sum). Before it, the widest-output
    linear's output side (up_proj's: lora_B's fp32 output and its scaled copy beside the base output, which stands in
    for the layer's saved output), while the widest-input linear's kept LoRA input does not exist yet; above the end
    without dropout. Beside either, the gradients in flight when the backward asks for the recompute: the layer
    output's (c·h), peft's scaled fp32 gradient of lora_B's output and, with an unquantized base, the base output's
    gradient cast back to c bytes (peft adds the fp32 LoRA output to it; bitsandbytes' LoRA casts first, in c).

    With the LoRA weights in the compute dtype (`lora_in_compute_dtype`) peft casts nothing and its branch runs in c
    bytes (`linears.lora_bytes`): the end holds the widest-input linear's input only where dropout copies it (without,
    lora_A keeps the input itself), the output side two c-byte tensors, and the gradients in flight are c bytes with
    no cast back (code read in peft 0.21 lora/layer.py and bnb.py; traced on one FSDP2 rank,
    benchmarks/fsdp_verify.md)."""
    c = DTYPE_BYTES[s.compute_dtype]
    h, fp32 = arch.hidden_size, RECOMPUTE_END_FP32
    mixed = s.lora_in_compute_dtype
    b = lora_bytes(s) if mixed else fp32
    lins = lora_linears(arch, s)
    wide_in, wide_out = max(lin.in_features for lin in lins), max(lin.out_features for lin in lins)
    kept_in = _kept_lora_input(s)
    cast = fp32 if c < fp32 and not mixed else 0
    end = (c + cast - (0 if s.lora_dropout > 0 else b)) * wide_in + RECOMPUTE_END_BESIDE * c * h
    output_side = (2 * b - kept_in) * wide_out + (RECOMPUTE_END_BESIDE - 1) * c * h
    base_grad = c if s.quantization == "none" and c < fp32 and not mixed else 0
    grads = (c + (b if mixed else RECOMPUTE_END_GRAD_FP32) + base_grad) * h
    return (max(end, output_side) + grads) * s.tokens


def recomputed_layer_bytes(arch: Architecture, s: Setup, dequant: float) -> float:
    """The checkpointed backward's layer moment beyond what the layer saves: `recompute_end_bytes`, or with a
    quantized base (`dequant`: its largest linear dequantized, c bytes per weight) the widest-input linear's base
    backward, the larger. There the weight is dequantized beside that linear's two c-byte input gradients (its LoRA
    branch's and its base's) and the layer output's, its kept LoRA input freed (traced on Llama-3.1-8B cut to one
    layer, NF4, 1 x 512: the peak; at 2,048 tokens the recompute's end is)."""
    moment = recompute_end_bytes(arch, s)
    if not dequant:
        return moment
    c = DTYPE_BYTES[s.compute_dtype]
    wide_in = max(lin.in_features for lin in lora_linears(arch, s))
    kept_in = _kept_lora_input(s)
    base_backward = dequant + ((2 * c - kept_in) * wide_in + c * arch.hidden_size) * s.tokens
    return max(moment, base_backward)


def head_freed_bytes(arch: Architecture, s: Setup) -> float:
    """What the head saved and its backward freed before any layer's backward (the final norm's tensors and the
    loss input: `head_saved_bytes` less RoPE's cos/sin and the loss's bookkeeping, alive until the step ends); 0
    where the layer moment is not `recompute_end_bytes`' (its measured terms were fitted with the head alive)."""
    if not ends_recomputed_forward(arch, s):
        return 0.0
    c = DTYPE_BYTES[s.compute_dtype]
    kept = 2 * c * arch.head_dim + TOKEN_BOOKKEEPING_BYTES
    return (head_saved_bytes(arch, s) - kept) * s.tokens
