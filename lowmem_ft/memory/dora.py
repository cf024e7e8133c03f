"""DoRA's memory (peft's `use_dora`): what a magnitude-decomposed LoRA adds to plain LoRA, per adapted linear.

The one idea: DoRA rescales each adapted linear's output by magnitude / ‖W + s·BA‖ (per output feature), and peft
recomputes that weight norm in every forward (tuners/lora/dora.py `DoraLinearLayer.forward`, no cache in training).
So it costs three things beyond LoRA: the magnitude vectors (trainable, fp32: `static._trainable_tensors`), what the
rescaling keeps for backward (`kept_per_token`, `kept_per_layer`), and the weight norm's working set in forward —
the identity matrix lora_weight is made from, the full lora_weight, W + s·lora_weight, and under QLoRA the
dequantized W (`forward_transient`). With dropout on and a weight that is not fp32 (16-bit or quantized storage),
peft recomputes the base output as F.linear(x, W.to(fp32)), and autograd keeps that fp32 weight copy for backward
(`weight_copies`).
Where the LoRA weights run in the compute dtype (`Setup.lora_in_compute_dtype`, FSDP's mixed precision: the
magnitude too) x stays in c bytes, and so does every tensor above that is fp32 on one device (`linears.lora_bytes`);
read from peft 0.21 dora.py / variants.py, not traced (no DoRA plan in benchmarks/fsdp_verify.md).
"""

from __future__ import annotations

from lowmem_ft.memory.arch import Architecture, Linear
from lowmem_ft.memory.calibration import DORA_KEPT_LORA_OUT_BYTES, DORA_NORM_BYTES_PER_OUT
from lowmem_ft.memory.linears import lora_bytes
from lowmem_ft.memory.records import DTYPE_BYTES, Setup


def kept_per_token(s: Setup, lins: list[Linear]) -> float:
    """Per token, what DoRA keeps for backward for these adapted linears: the base output (c B, fp32 with dropout)
    and lora_B's fp32 output, per output feature (`DORA_KEPT_LORA_OUT_BYTES`; measured, see calibration)."""
    if not s.use_dora or s.adapter != "lora":
        return 0.0
    base = 4 if s.lora_dropout > 0 and not s.lora_in_compute_dtype else DTYPE_BYTES[s.compute_dtype]
    lora_out = lora_bytes(s) if s.lora_in_compute_dtype else DORA_KEPT_LORA_OUT_BYTES
    return sum((base + lora_out) * lin.out_features for lin in lins)


def kept_per_layer(s: Setup, lins: list[Linear]) -> float:
    """Per decoder layer, independent of tokens: the weight norm, the scale and the scale − 1 per output feature
    (`DORA_NORM_BYTES_PER_OUT`), plus the fp32 weight copies with dropout (`weight_copies`)."""
    if not s.use_dora or s.adapter != "lora":
        return 0.0
    per_out = 3 * lora_bytes(s) if s.lora_in_compute_dtype else DORA_NORM_BYTES_PER_OUT
    return per_out * sum(lin.out_features for lin in lins) + weight_copies(s, lins)


def weight_copies(s: Setup, lins: list[Linear]) -> float:
    """Per layer, the fp32 copies of the base weights that F.linear keeps for backward when dropout is on and the
    weight is not fp32 already (read from peft dora.py: `weight.to(x.dtype)` with x in the adapter's fp32; with
    fp32 weights `.to` returns the weight itself). Not measured: the CPU runs the suite measures use fp32 weights.
    With the LoRA weights in the compute dtype x is c bytes: a 16-bit weight is kept as it is (its gathered
    storage, not a copy), a quantized one as its c-byte dequantized copy."""
    if s.lora_dropout <= 0 or (s.quantization == "none" and s.compute_dtype == "float32"):
        return 0.0
    if s.lora_in_compute_dtype:
        if s.quantization == "none":
            return 0.0
        return sum(DTYPE_BYTES[s.compute_dtype] * lin.in_features * lin.out_features for lin in lins)
    return sum(4 * lin.in_features * lin.out_features for lin in lins)


def forward_transient(arch: Architecture, s: Setup, lins: list[Linear]) -> float:
    """The largest weight-norm working set of one adapted linear, in forward (and again in a checkpointed layer's
    recompute), read from peft dora.py: `get_lora_weight` runs lora_A and lora_B over an fp32 identity of
    in_features (4·in² B, then 4·in·r and the 4·in·out lora_weight), `get_weight_norm` adds scaling·lora_weight to
    W (two more out × in tensors in the adapter's fp32), and a quantized W is first dequantized (c·in·out). Read
    from code, not measured at its own peak: on the suite's tiny models the loss's working set is larger."""
    if not s.use_dora or s.adapter != "lora" or not lins:
        return 0.0
    c, b = DTYPE_BYTES[s.compute_dtype], lora_bytes(s)

    def one(lin: Linear) -> float:
        i, o = lin.in_features, lin.out_features
        dequantized = c * i * o if s.quantization != "none" else 0
        return b * i * i + b * i * s.lora_r + 3 * b * i * o + dequantized

    return max(one(lin) for lin in lins)
