"""Which linears LoRA adapts, and what peft's LoRA layers keep for backward per token (what the recomputed LoRA
branches keep instead is `lowmem_ft.memory.savers.RecomputeLora`).

The one idea: peft's LoRA branch computes in its weights' dtype. On one device peft keeps the adapters fp32
(`autocast_adapter_dtype`) and casts each input up to them (tuners_utils.py `_cast_input_dtype`: `x.to(dtype)`
unless the dtypes agree), so every adapted linear makes an fp32 copy of its input. Where the plan runs the LoRA
weights in the compute dtype (`Setup.lora_in_compute_dtype`: FSDP's 16-bit mixed precision gathers them so), the
cast is a no-op, the branch's tensors are c bytes (`lora_bytes`), and without dropout lora_A keeps the very tensor
the base linear reads, one per input however many linears read it (`shared_input_bytes`).
"""

from __future__ import annotations

from lowmem_ft.memory.arch import Architecture, Linear
from lowmem_ft.memory.calibration import DROPOUT_MASK_BYTES
from lowmem_ft.memory.records import DTYPE_BYTES, Setup


def lora_linears(arch: Architecture, s: Setup) -> list[Linear]:
    targets = arch.lora_targets(list(s.lora_targets))
    return targets


ATTENTION_INPUT_LINEARS = {"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn"}  # fed by the input RMSNorm


MLP_LINEARS = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2"}  # inside `layers.N.mlp`


def is_mlp_linear(arch: Architecture, lin: Linear) -> bool:
    """A linear of the decoder MLP (what the tiled MLP tiles)."""
    return lin.name in MLP_LINEARS


def lora_bytes(s: Setup) -> int:
    """Bytes per element of peft's LoRA branch tensors (its input's cast, the dropped copy, lora_A's and lora_B's
    outputs): fp32 (4) on one device, c where the LoRA weights run in the compute dtype (`lora_in_compute_dtype`)."""
    return DTYPE_BYTES[s.compute_dtype] if s.lora_in_compute_dtype else 4


def lora_cast_bytes(s: Setup) -> int:
    """Per input element, the copy `_cast_input_dtype` makes of an adapted linear's input: 4 B (peft's fp32 adapters;
    counted so even at fp32 compute, as measured with it), none where the LoRA weights run in the compute dtype."""
    return 0 if s.lora_in_compute_dtype else 4


def dropout_mask_bytes(s: Setup) -> float:
    """Per input element, the mask peft's LoRA dropout keeps (DROPOUT_MASK_BYTES on the device); none without it.
    On the CPU the mask is a noise tensor in the dropped input's dtype (ATen Dropout.cpp `_dropout_impl`: `input *
    noise`; only CUDA takes the fused kernel's bool mask): 4 B after peft's fp32 cast, c B in the compute dtype."""
    if s.lora_dropout <= 0:
        return 0
    if s.device == "cpu" and s.lora_in_compute_dtype:
        return lora_bytes(s)
    return DROPOUT_MASK_BYTES[s.device]


def fused_qkv(arch: Architecture) -> bool:
    """Whether one linear projects q, k and v (Phi-3's qkv_proj, GPT-2-style c_attn): SDPA gets views of its output."""
    return any(lin.name in ("qkv_proj", "c_attn") for lin in arch.linears)


def peft_lora_input_bytes(arch: Architecture, s: Setup, lins: list[Linear], drop: float) -> float:
    """Per token, what peft's LoRA layers keep for these adapted linears: x.to(fp32) → dropout keeps its mask (`drop`
    bytes per element, DROPOUT_MASK_BYTES), lora_A keeps the fp32 dropped input (4 B), lora_B keeps lora_A's output
    (4 B × r). Each adapted linear does this on its own (`savers.RECOMPUTE_LORA.lora_inputs` chooses this or the
    recomputed branches' inputs).

    With the LoRA weights in the compute dtype (`lora_in_compute_dtype`) there is no cast: with dropout each linear
    keeps its mask and its dropped copy (c + `drop` B per element), without it lora_A keeps the input itself
    (`shared_input_bytes`); lora_A's output is c B × r. Read from peft 0.21 lora/layer.py and bnb.py
    `Linear.forward`; traced on one FSDP2 rank at full size (benchmarks/fsdp_verify.md)."""
    b = lora_bytes(s)
    outputs = sum(b * s.lora_r for lin in lins)
    if s.lora_in_compute_dtype and not drop:
        return shared_input_bytes(arch, s, lins) + outputs
    return sum((b + drop) * lin.in_features for lin in lins) + outputs


def shared_input_bytes(arch: Architecture, s: Setup, lins: list[Linear]) -> float:
    """Per token, the c-byte inputs of these adapted linears counted once per tensor: one for the linears fed by the
    same norm (q/k/v, gate/up: nothing else keeps a norm's output, a frozen base linear keeps no input), one for
    down_proj (the act × up product), none for the attention's output projection: its input is the attention output
    the attention keeps already (SDPA / flash kernels return it in (batch, seq, heads, head_dim) memory order, so
    transformers' `transpose(1, 2).contiguous()` is that storage)."""
    c = DTYPE_BYTES[s.compute_dtype]
    shared = {"attn": ATTENTION_INPUT_LINEARS, "mlp": {"gate_proj", "up_proj", "gate_up_proj", "w1", "w2"}}
    inputs: dict[str, int] = {}
    for lin in lins:
        if lin.name == "o_proj" or (lin.name == "c_proj" and not is_mlp_linear(arch, lin)):
            continue
        group = next((g for g, names in shared.items() if lin.name in names), lin.name)
        inputs[group] = lin.in_features
    return c * sum(inputs.values())
