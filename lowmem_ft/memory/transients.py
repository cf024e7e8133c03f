"""What is in flight at the decoder layers' forward and backward peaks beyond what they keep: peft's fp32
copies around the widest adapted linear, the final norm's forward, a masked layer's SDPA moment, the recomputed
layer's gradients, and the long-context savers' moments (tiled MLP tiles, tiled norms, LoRA recompute).
"""

from __future__ import annotations

from lowmem_ft.memory.activations import masked_layers, mlp_activation_bytes
from lowmem_ft.memory.arch import Architecture, Linear
from lowmem_ft.memory.calibration import (
    DROPOUT_MASK_BYTES,
    FWD_BESIDE_CKPT,
    FWD_BESIDE_NO_CKPT,
    FWD_BESIDE_NO_CKPT_TILED_NORMS,
    FWD_OUTPUT_FP32,
    FWD_TOKEN_STATS_BYTES,
    FWD_TRANSIENT_CKPT,
    FWD_TRANSIENT_NO_CKPT,
    NORM_BWD_BYTES_PER_H,
    RECOMPUTE_BWD_H,
    RECOMPUTE_BWD_I,
    RECOMPUTE_BWD_I_LORA_RECOMPUTED,
    TILE_BWD_I,
    TILE_BWD_I_TILED_NORMS,
    TILED_NORMS_BWD_H,
    TILED_NORMS_RECOMPUTE_BWD_H,
    TILED_RECOMPUTE_BWD_H,
)
from lowmem_ft.memory.experts import (
    moe_backward_transient_bytes,
    moe_forward_transient_bytes,
    unused_sliding_mask_bytes,
)
from lowmem_ft.memory.linears import is_mlp_linear, lora_linears
from lowmem_ft.memory.records import DTYPE_BYTES, Setup, mlp_tile_tokens


def tiled_mlp_transient_bytes(arch: Architecture, s: Setup) -> float:
    """With `tiled_mlp`, the MLP's backward working set beyond the layer's saved tensors: one tile's recomputed MLP
    tensors and TILE_BWD_I·i B per tile token of gradients, beside the tiles' input gradients (c·h per token)."""
    c = DTYPE_BYTES[s.compute_dtype]
    tile = mlp_tile_tokens(arch, s)
    if s.tiled_norms:
        return tile * (mlp_activation_bytes(arch, s) + TILE_BWD_I_TILED_NORMS * arch.intermediate_size)
    per_tile_token = mlp_activation_bytes(arch, s) + TILE_BWD_I * arch.intermediate_size
    return tile * per_tile_token + c * arch.hidden_size * s.tokens


def forward_transient_bytes(arch: Architecture, s: Setup) -> float:
    """The largest transient of one layer's forward beyond what the layers keep (FWD_TRANSIENT_* and FWD_BESIDE_*,
    measured at the layers' own peak): peft's fp32 copies around the adapted linear with the widest input, beside
    the hidden-sized tensors in flight. With `tiled_mlp` the MLP's linears see one tile at a time, under the tile's
    checkpoint (nothing kept), beside the tile outputs gathered so far, the residual sum and the MLP input (3·c·h
    per token: the forward of the yardstick's 1,024-token-tile points, where this moment is the peak, is exact on
    the three shapes); under checkpointing the attention's output projection is the other moment
    (`_attention_output_bytes`). RoPE's cos/sin, which also exist while the layers run, are the caller's
    (`_forward_backward`)."""
    if arch.moe:  # the experts' moment, or the attention's (whose LoRA copies are measured as for dense blocks)
        moments = max(moe_forward_transient_bytes(arch, s), _dense_forward_transient_bytes(arch, s))
        return moments + unused_sliding_mask_bytes(arch, s)
    return _dense_forward_transient_bytes(arch, s)


def _dense_forward_transient_bytes(arch: Architecture, s: Setup) -> float:
    """`forward_transient_bytes` of a block with a dense MLP (or the attention's moment of an MoE block)."""
    if s.adapter == "full":
        return 0.0
    c = DTYPE_BYTES[s.compute_dtype]
    h, t = arch.hidden_size, s.tokens
    drop = DROPOUT_MASK_BYTES[s.device] if s.lora_dropout > 0 else 0
    lins = lora_linears(arch, s)
    if s.recompute_lora:
        return recompute_forward_transient_bytes(arch, s, lins) + FWD_TOKEN_STATS_BYTES * t
    outside = [lin for lin in lins if not (s.tiled_mlp and is_mlp_linear(arch, lin))]
    wide = max(outside, key=lambda lin: lin.in_features, default=None)
    wide_in = wide.in_features if wide else 0
    if s.gradient_checkpointing:
        transient = ((c + drop + FWD_TRANSIENT_CKPT) * wide_in + FWD_BESIDE_CKPT * c * h) * t
        if s.tiled_mlp:
            transient = max(transient, _attention_output_bytes(arch, s, (drop + FWD_TRANSIENT_CKPT) * wide_in))
    elif s.tiled_mlp:  # the attention's linears, with two hidden-sized tensors beside (measured)
        transient = ((c + drop + FWD_TRANSIENT_NO_CKPT) * wide_in + 2 * c * h) * t
    else:
        beside = FWD_BESIDE_NO_CKPT_TILED_NORMS if s.tiled_norms else FWD_BESIDE_NO_CKPT
        wide_out = wide.out_features if wide else 0
        transient = ((c + FWD_TRANSIENT_NO_CKPT) * wide_in + (c + FWD_OUTPUT_FP32) * wide_out + beside * c * h) * t
    if s.tiled_mlp:
        inside = max((lin.in_features for lin in lins if is_mlp_linear(arch, lin)), default=0)
        tile = mlp_tile_tokens(arch, s)
        transient = max(transient, (c + drop + FWD_TRANSIENT_CKPT) * inside * tile + 3 * c * h * t)
    return transient + FWD_TOKEN_STATS_BYTES * t


def _attention_output_bytes(arch: Architecture, s: Setup, lora_copies: float) -> float:
    """Under checkpointing with `tiled_mlp`: the moment of the attention's output projection — q, k, v and the
    attention output (c bytes each), the norm output and the projection's base output (c·h each) and its LoRA
    copies (`lora_copies` bytes per token; measured, see FWD_TRANSIENT_CKPT)."""
    c = DTYPE_BYTES[s.compute_dtype]
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return (c * (2 * q + 2 * kv) + 2 * c * arch.hidden_size + lora_copies) * s.tokens


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
    repeated = 2 * q if kv < q else 0
    tensors = c * (2 * q + 2 * kv + repeated + arch.hidden_size) + 4 * arch.num_heads + FWD_TOKEN_STATS_BYTES
    return c * s.micro_batch_size * s.max_seq_len**2 + tensors * t


def final_norm_forward_bytes(arch: Architecture, s: Setup) -> float:
    """The final RMSNorm's forward beside what the layers keep: the last layer's output (its input) and, without
    checkpointing, the model's input embeddings (its forward holds `inputs_embeds`; under checkpointing they are the
    first layer's kept input), then the fp32 upcast, the normalized fp32 copy, its cast back and the weighted output
    (4 + 4 + c + c per element; Gemma's norm multiplies in fp32 and casts once: 4 + 4 + 4 + c) and the per-token mean
    and rsqrt. Measured at the forward's peak with PeakMemory (op attribution): 2,056 B/token on the Llama-shaped
    yardstick model (h 128) without checkpointing, where it is above the loss's forward. A tiled norm's fp32 copies
    exist for one tile at a time (0: the layers' or the loss's moment is larger)."""
    if s.tiled_norms:
        return 0.0
    c, h = DTYPE_BYTES[s.compute_dtype], arch.hidden_size
    stream = c * h * (1 if s.gradient_checkpointing else 2)
    copies = (12 + c if arch.norm_fp32_output else 8 + 2 * c) * h
    return (stream + copies + FWD_TOKEN_STATS_BYTES) * s.tokens


def recompute_forward_transient_bytes(arch: Architecture, s: Setup, lins: list[Linear]) -> float:
    """With `recompute_lora` the fp32 input copies live inside each branch's tile; what remains is output-side: the
    base layer's c-byte output and the branch's fp32 tile outputs and their concatenation (FWD_TRANSIENT_CKPT bytes
    per output element; peft's plain Linear then adds them in fp32), for the adapted linear with the widest output,
    beside one c-byte tensor of the widest live activation and the two hidden-sized ones of FWD_BESIDE_CKPT. Without
    checkpointing part of the fp32 output is kept already (FWD_TRANSIENT_NO_CKPT), beside three c-byte hidden-sized
    tensors (one with tiled MLP and norms: the rest are the tiled norms' kept inputs). With `tiled_mlp` under
    checkpointing the attention's output projection is the larger moment; one MLP tile's moment as in
    `forward_transient_bytes`. Measured as FWD_TRANSIENT_CKPT says: within 4 B/token on the three shapes."""
    c = DTYPE_BYTES[s.compute_dtype]
    h, t = arch.hidden_size, s.tokens
    outside = [lin for lin in lins if not (s.tiled_mlp and is_mlp_linear(arch, lin))]
    widest = max((lin.out_features for lin in outside), default=0)
    live = max([h] + [arch.intermediate_size for lin in outside if is_mlp_linear(arch, lin)])
    if s.gradient_checkpointing:
        transient = ((c + FWD_TRANSIENT_CKPT) * widest + c * live + (FWD_BESIDE_CKPT - 1) * c * h) * t
        if s.tiled_mlp:
            transient = max(transient, _attention_output_bytes(arch, s, FWD_TRANSIENT_CKPT * h))
    else:
        beside = 1 if s.tiled_mlp and s.tiled_norms else 3
        transient = ((c + FWD_TRANSIENT_NO_CKPT) * widest + beside * c * h) * t
    if s.tiled_mlp:
        inside = max((lin.out_features for lin in lins if is_mlp_linear(arch, lin)), default=0)
        tile = mlp_tile_tokens(arch, s)
        i = arch.intermediate_size
        transient = max(transient, ((c + FWD_TRANSIENT_CKPT) * inside + c * i) * tile + 3 * c * h * t)
    return transient


def backward_transient_bytes(arch: Architecture, s: Setup) -> tuple[float, str]:
    """Gradients in flight at the backward's peak beyond the saved tensors, and where the figure comes from: with
    checkpointing, the recomputed layer's; without, the final norm's fp32 backward (all measured, see the constants)."""
    h, i, t = arch.hidden_size, arch.intermediate_size, s.tokens
    if arch.moe:
        return moe_backward_transient_bytes(arch, s)
    tile = mlp_tile_tokens(arch, s)
    if s.gradient_checkpointing:
        if s.tiled_mlp:
            attn_h = TILED_RECOMPUTE_BWD_H
            if s.tiled_norms:
                attn_h = TILED_NORMS_RECOMPUTE_BWD_H if s.recompute_lora else TILED_NORMS_BWD_H
            grads = max(attn_h * h * t, tiled_mlp_transient_bytes(arch, s))
            return grads, f"attention gradients or one MLP tile of {tile} tokens (measured)"
        bwd_i = RECOMPUTE_BWD_I_LORA_RECOMPUTED if s.recompute_lora and s.adapter == "lora" else RECOMPUTE_BWD_I
        return (bwd_i * i + RECOMPUTE_BWD_H * h) * t, "recomputed layer's MLP/LoRA gradients (measured)"
    grads = NORM_BWD_BYTES_PER_H * h * (tile if s.tiled_norms else t)
    if s.tiled_mlp:  # the last layer's MLP tiles are recomputed while every layer's activations are kept
        return max(grads, tiled_mlp_transient_bytes(arch, s)), "final RMSNorm backward or one MLP tile (measured)"
    return grads, "final RMSNorm backward, fp32 (measured)"
