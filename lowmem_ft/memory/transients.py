"""What is in flight at the decoder layers' forward and backward peaks beyond what they keep: peft's fp32
copies around the widest adapted linear, the final norm's forward, a masked layer's SDPA moment, the recomputed
layer's gradients; the long-context savers' moments are theirs (`lowmem_ft.memory.savers`), handed the moment here.
"""

from __future__ import annotations

from lowmem_ft.memory.activations import (
    eager_probs_bytes,
    eager_softmax_bytes,
    masked_layers,
    mlp_activation_bytes,
    repeats_kv_copy,
)
from lowmem_ft.memory.arch import Architecture, Linear
from lowmem_ft.memory.calibration import (
    FWD_BESIDE_CKPT,
    FWD_BESIDE_NO_CKPT,
    FWD_INPUT_CAST_FP32,
    FWD_OUTPUT_FP32,
    FWD_TOKEN_STATS_BYTES,
    FWD_TRANSIENT_CKPT,
    FWD_TRANSIENT_NO_CKPT,
    RECOMPUTE_BWD_H,
    RECOMPUTE_BWD_I,
)
from lowmem_ft.memory.experts import (
    moe_backward_transient_bytes,
    moe_forward_transient_bytes,
    unused_sliding_mask_bytes,
)
from lowmem_ft.memory.linears import (
    ATTENTION_INPUT_LINEARS,
    dropout_mask_bytes,
    is_mlp_linear,
    lora_bytes,
    lora_linears,
)
from lowmem_ft.memory.recompute import ends_recomputed_forward, recompute_end_bytes
from lowmem_ft.memory.records import DTYPE_BYTES, Setup
from lowmem_ft.memory.savers import RECOMPUTE_LORA, TILED_MLP, TILED_NORMS


def tiled_mlp_transient_bytes(arch: Architecture, s: Setup) -> float:
    """The tiled MLP's backward working set beyond the layer's saved tensors (`savers.TiledMLP.tile_backward`)."""
    return TILED_MLP.tile_backward(arch, s, mlp_activation_bytes(arch, s))


def forward_transient_bytes(arch: Architecture, s: Setup) -> float:
    """The largest transient of one layer's forward beyond what the layers keep (FWD_TRANSIENT_* and FWD_BESIDE_*,
    measured at the layers' own peak): peft's fp32 copies around the adapted linear with the widest input, beside
    the hidden-sized tensors in flight; the savers' moments are theirs (`savers.TiledMLP.forward`,
    `savers.RecomputeLora.forward`, `savers.TiledNorms.forward_beside`). RoPE's cos/sin, which also exist while the
    layers run, are the caller's (`_forward_backward`). Under checkpointing an eager layer's probabilities are held
    beside them (`activations.eager_probs_bytes`); without, they are among the kept tensors."""
    probs = eager_probs_bytes(arch, s) if s.gradient_checkpointing else 0.0
    if arch.moe:  # the experts' moment, or the attention's (whose LoRA copies are measured as for dense blocks)
        moments = max(moe_forward_transient_bytes(arch, s), _dense_forward_transient_bytes(arch, s))
        return moments + unused_sliding_mask_bytes(arch, s) + probs
    return _dense_forward_transient_bytes(arch, s) + probs


def _dense_forward_transient_bytes(arch: Architecture, s: Setup) -> float:
    """`forward_transient_bytes` of a block with a dense MLP (or the attention's moment of an MoE block)."""
    if s.adapter == "full":
        return 0.0
    c = DTYPE_BYTES[s.compute_dtype]
    h, t = arch.hidden_size, s.tokens
    drop = dropout_mask_bytes(s)
    lins = lora_linears(arch, s)
    if RECOMPUTE_LORA.on(s):
        return RECOMPUTE_LORA.forward(arch, s, lins) + FWD_TOKEN_STATS_BYTES * t
    outside = [lin for lin in lins if not TILED_MLP.tiles(arch, s, lin)]
    wide = max(outside, key=lambda lin: lin.in_features, default=None)
    wide_in = wide.in_features if wide else 0
    copies, cast, output = lora_branch_bytes(s)
    if s.gradient_checkpointing:
        transient = ((c + drop + copies) * wide_in + FWD_BESIDE_CKPT * c * h) * t
        transient = max(transient, lora_output_side_bytes(arch, s, outside) * t)
    else:
        beside = TILED_NORMS.forward_beside(s, FWD_BESIDE_NO_CKPT)
        wide_out = wide.out_features if wide else 0
        cast = FWD_TRANSIENT_NO_CKPT if cast else 0  # the same cast, measured without checkpointing
        transient = ((c + cast) * wide_in + (c + output) * wide_out + beside * c * h) * t
    return TILED_MLP.forward(arch, s, lins, transient, wide_in) + FWD_TOKEN_STATS_BYTES * t


def lora_branch_bytes(s: Setup) -> tuple[float, float, float]:
    """Per element, peft's LoRA branch in flight around an adapted linear in forward: (the input's copies at the
    widest input under checkpointing, the input's cast, the output side beyond the base output). With peft's fp32
    adapters the measured FWD_TRANSIENT_CKPT (cast and dropped copy), FWD_INPUT_CAST_FP32 (the cast; measured
    without checkpointing as FWD_TRANSIENT_NO_CKPT) and FWD_OUTPUT_FP32 (lora_B's fp32 output and its scaled copy). With the LoRA weights in the compute
    dtype (`lora_in_compute_dtype`) peft casts nothing (`_cast_input_dtype` returns x), dropout copies the input in
    c bytes, and lora_B's output and its scaled copy are c bytes each; read from peft 0.21 lora/layer.py and bnb.py
    `Linear.forward`, traced on one FSDP2 rank (benchmarks/fsdp_verify.md)."""
    if not s.lora_in_compute_dtype:
        return FWD_TRANSIENT_CKPT, FWD_INPUT_CAST_FP32, FWD_OUTPUT_FP32
    b = lora_bytes(s)
    return (b if s.lora_dropout > 0 else 0), 0, 2 * b


def lora_output_side_bytes(arch: Architecture, s: Setup, lins: list[Linear]) -> float:
    """Per token, under checkpointing, peft's LoRA forward on its output side at the norm-fed adapted linear where
    that is largest (FWD_INPUT_CAST_FP32): the base output, lora_B's fp32 output and its scaled copy, its input and
    the input's fp32 cast, beside what the block holds then (`_norm_fed_beside`). The larger moment than the widest
    input's where an output is wide: a fused projection (Phi-3's gate_up_proj, 2·i from h), or any gate/up pair
    once the dropout's copies are gone (dropout 0) or small (CUDA's 1-byte masks)."""
    c = DTYPE_BYTES[s.compute_dtype]
    _, cast, output = lora_branch_bytes(s)
    best = 0.0
    for lin in lins:
        beside = _norm_fed_beside(arch, lin)
        if beside is not None:
            side = (c + output) * lin.out_features + (c + cast) * lin.in_features
            best = max(best, side + c * beside)
    return best


def _norm_fed_beside(arch: Architecture, lin: Linear) -> int | None:
    """Elements per token the block holds beside a linear that reads a norm's output (None for the others: the
    attention's output projection and the MLP's down projection, whose output is hidden-sized), from the modeling
    code's order: the outputs of the same block's projections computed before it (k after q, v after q and k; up
    after act(gate), which outlives gate's output), and in the MLP the residual sum after the attention."""
    h = arch.hidden_size
    if lin.name in ATTENTION_INPUT_LINEARS:
        group = [x for x in arch.linears if x.name in ATTENTION_INPUT_LINEARS]
        residual = 0
    elif is_mlp_linear(arch, lin) and lin.in_features == h:
        group = [x for x in arch.linears if is_mlp_linear(arch, x) and x.in_features == h]
        residual = h
    else:
        return None
    before = group[: next((k for k, x in enumerate(group) if x.name == lin.name), 0)]
    return residual + sum(x.out_features for x in before)


def attention_forward_bytes(arch: Architecture, s: Setup) -> float:
    """Under checkpointing, the attention's own moment beyond the kept tensors, when it has one above the linears':
    a masked layer's SDPA (`masked_attention_forward_bytes`) or eager attention's softmax
    (`activations.eager_softmax_bytes`; the layer's input is among the kept). 0 otherwise."""
    if not s.gradient_checkpointing:
        return 0.0
    eager = eager_softmax_bytes(arch, s) + FWD_TOKEN_STATS_BYTES * s.tokens if s.attn_implementation == "eager" else 0
    return max(masked_attention_forward_bytes(arch, s), eager)


def masked_attention_forward_bytes(arch: Architecture, s: Setup) -> float:
    """Under checkpointing, a masked layer's SDPA moment (`masked_layers`; 0 when none): the c-byte additive mask
    SDPA makes from the bool one (b × s × s, kept per layer when not checkpointing: `_attention_bytes`), beside q, k,
    v and the output (c each; with GQA `repeat_kv` adds k and v expanded to every head), the norm output (c·h), the
    logsumexp (fp32 per head) and the per-token statistics. Measured at the layers' peak (PeakMemory, op
    attribution) on the yardstick's Mistral shape with a 2,048-token window at 4,096 tokens: 9,820 B/token, exact;
    the repeated k/v are read from transformers' sdpa_attention.py, not measured. The additive mask lives only
    through SDPA, so this is a moment of its own, not added to the layer's other transients."""
    if not (s.gradient_checkpointing and masked_layers(arch, s)):
        return 0.0
    c, t = DTYPE_BYTES[s.compute_dtype], s.tokens
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    repeated = 2 * q if kv < q and repeats_kv_copy(arch) else 0
    tensors = c * (2 * q + 2 * kv + repeated + arch.hidden_size) + 4 * arch.num_heads + FWD_TOKEN_STATS_BYTES
    return c * s.micro_batch_size * s.max_seq_len**2 + tensors * t


def final_norm_forward_bytes(arch: Architecture, s: Setup) -> float:
    """The final RMSNorm's forward beside what the layers keep: the last layer's output (its input) and, without
    checkpointing, the model's input embeddings (its forward holds `inputs_embeds`; under checkpointing they are the
    first layer's kept input), then the fp32 upcast, the normalized fp32 copy, its cast back and the weighted output
    (4 + 4 + c + c per element; Gemma's norm multiplies in fp32 and casts once: 4 + 4 + 4 + c) and the per-token mean
    and rsqrt. Measured at the forward's peak with PeakMemory (op attribution): 2,056 B/token on the Llama-shaped
    yardstick model (h 128) without checkpointing, where it is above the loss's forward. A tiled norm's fp32 copies
    exist for one tile at a time (`savers.TiledNorms.final_norm_forward`)."""
    c, h = DTYPE_BYTES[s.compute_dtype], arch.hidden_size
    stream = c * h * (1 if s.gradient_checkpointing else 2)
    copies = (12 + c if arch.norm_fp32_output else 8 + 2 * c) * h
    return TILED_NORMS.final_norm_forward(s, (stream + copies + FWD_TOKEN_STATS_BYTES) * s.tokens)


def recompute_forward_transient_bytes(arch: Architecture, s: Setup, lins: list[Linear]) -> float:
    """The forward moment of the recomputed LoRA branches (`savers.RecomputeLora.forward`)."""
    return RECOMPUTE_LORA.forward(arch, s, lins)


def backward_transient_bytes(arch: Architecture, s: Setup) -> tuple[float, str]:
    """Gradients in flight at the backward's peak beyond the saved tensors, and where the figure comes from: with
    checkpointing, the recomputed layer's (with peft's LoRA branches the end of its recomputed forward:
    `recompute.recompute_end_bytes`); without, the final norm's fp32 backward (all measured, see the constants)."""
    h, i, t = arch.hidden_size, arch.intermediate_size, s.tokens
    if arch.moe:
        return moe_backward_transient_bytes(arch, s)
    if s.gradient_checkpointing:
        if TILED_MLP.on(s):
            return TILED_MLP.recomputed_backward(arch, s, mlp_activation_bytes(arch, s))
        if ends_recomputed_forward(arch, s):
            return recompute_end_bytes(arch, s), "the recomputed forward's end: input copies and gradients (traced)"
        bwd_i = RECOMPUTE_LORA.recomputed_mlp_bwd_i(s, RECOMPUTE_BWD_I)
        return (bwd_i * i + RECOMPUTE_BWD_H * h) * t, "recomputed layer's MLP/LoRA gradients (measured)"
    grads = TILED_NORMS.final_norm_backward(arch, s)
    if TILED_MLP.on(s):  # the last layer's MLP tiles are recomputed while every layer's activations are kept
        return max(grads, tiled_mlp_transient_bytes(arch, s)), "final RMSNorm backward or one MLP tile (measured)"
    return grads, "final RMSNorm backward, fp32 (measured)"
