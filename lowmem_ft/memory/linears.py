"""Which linears LoRA adapts, and what peft's LoRA layers keep for backward per token (or, with
`memory.recompute_lora`, what each branch's checkpoint keeps instead).
"""

from __future__ import annotations

from lowmem_ft.memory import dora
from lowmem_ft.memory.arch import Architecture, Linear
from lowmem_ft.memory.calibration import DROPOUT_MASK_BYTES
from lowmem_ft.memory.families import family
from lowmem_ft.memory.records import DTYPE_BYTES, Setup


def lora_linears(arch: Architecture, s: Setup) -> list[Linear]:
    targets = arch.lora_targets(list(s.lora_targets))
    return targets


ATTENTION_INPUT_LINEARS = {"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn"}  # fed by the input RMSNorm


MLP_LINEARS = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2"}  # inside `layers.N.mlp`


def is_mlp_linear(arch: Architecture, lin: Linear) -> bool:
    """A linear of the decoder MLP (what `memory.tiled_mlp` tiles); Qwen v1's MLP `c_proj` is told from the
    attention's by its input width (intermediate vs hidden)."""
    if lin.name == "c_proj":
        return family(arch.model_type).mlp_c_proj and lin.in_features == arch.intermediate_size
    return lin.name in MLP_LINEARS


def _lora_input_bytes(arch: Architecture, s: Setup, mlp: bool) -> float:
    """Per token, what peft's LoRA layers keep for the attention (`mlp` False) or MLP (True) linears: x.to(fp32) →
    dropout keeps its mask (DROPOUT_MASK_BYTES), lora_A keeps the fp32 dropped input (4 B), lora_B keeps lora_A's
    output (4 B × r). Each adapted linear does this on its own."""
    drop = DROPOUT_MASK_BYTES[s.device] if s.lora_dropout > 0 else 0
    lins = [lin for lin in lora_linears(arch, s) if is_mlp_linear(arch, lin) == mlp]
    if s.recompute_lora and not (mlp and s.tiled_mlp):
        return recomputed_lora_input_bytes(arch, s, lins) + dora.kept_per_token(s, lins)
    return sum((4 + drop) * lin.in_features + 4 * s.lora_r for lin in lins) + dora.kept_per_token(s, lins)


def recomputed_lora_input_bytes(arch: Architecture, s: Setup, lins: list[Linear]) -> float:
    """Per token, what `recompute_lora` keeps for these adapted linears: each branch checkpoint keeps only its input,
    a c-byte tensor — one for the linears fed by the same norm (q/k/v, gate/up: nothing else keeps a norm's output,
    a frozen base linear keeps no input), one for down_proj (the act × up product), none for the attention's output
    projection: its input is the attention output the attention keeps already (SDPA / flash kernels return it in
    (batch, seq, heads, head_dim) memory order, so transformers' `transpose(1, 2).contiguous()` is that storage).
    Measured per layer with PeakMemory (1- vs 2-layer models): 6,424 and 2,328 (with tiled_mlp) B/token for the
    Llama-shaped probe of tests/memory/test_estimate.py."""
    c = DTYPE_BYTES[s.compute_dtype]
    shared = {"attn": ATTENTION_INPUT_LINEARS, "mlp": {"gate_proj", "up_proj", "gate_up_proj", "w1", "w2"}}
    inputs: dict[str, int] = {}
    for lin in lins:
        if lin.name == "o_proj" or (lin.name == "c_proj" and not is_mlp_linear(arch, lin)):
            continue
        group = next((g for g, names in shared.items() if lin.name in names), lin.name)
        inputs[group] = lin.in_features
    return c * sum(inputs.values())
