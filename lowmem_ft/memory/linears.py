"""Which linears LoRA adapts, and what peft's LoRA layers keep for backward per token (what the recomputed LoRA
branches keep instead is `lowmem_ft.memory.savers.RecomputeLora`).
"""

from __future__ import annotations

from lowmem_ft.memory.arch import Architecture, Linear
from lowmem_ft.memory.calibration import DROPOUT_MASK_BYTES
from lowmem_ft.memory.records import Setup


def lora_linears(arch: Architecture, s: Setup) -> list[Linear]:
    targets = arch.lora_targets(list(s.lora_targets))
    return targets


ATTENTION_INPUT_LINEARS = {"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn"}  # fed by the input RMSNorm


MLP_LINEARS = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2"}  # inside `layers.N.mlp`


def is_mlp_linear(arch: Architecture, lin: Linear) -> bool:
    """A linear of the decoder MLP (what the tiled MLP tiles)."""
    return lin.name in MLP_LINEARS


def dropout_mask_bytes(s: Setup) -> float:
    """Per input element, the mask peft's LoRA dropout keeps (DROPOUT_MASK_BYTES on the device); none without it."""
    return DROPOUT_MASK_BYTES[s.device] if s.lora_dropout > 0 else 0


def fused_qkv(arch: Architecture) -> bool:
    """Whether one linear projects q, k and v (Phi-3's qkv_proj, GPT-2-style c_attn): SDPA gets views of its output."""
    return any(lin.name in ("qkv_proj", "c_attn") for lin in arch.linears)


def peft_lora_input_bytes(s: Setup, lins: list[Linear], drop: float) -> float:
    """Per token, what peft's LoRA layers keep for these adapted linears: x.to(fp32) → dropout keeps its mask (`drop`
    bytes per element, DROPOUT_MASK_BYTES), lora_A keeps the fp32 dropped input (4 B), lora_B keeps lora_A's output
    (4 B × r). Each adapted linear does this on its own (`savers.RECOMPUTE_LORA.lora_inputs` chooses this or the
    recomputed branches' inputs)."""
    return sum((4 + drop) * lin.in_features + 4 * s.lora_r for lin in lins)
