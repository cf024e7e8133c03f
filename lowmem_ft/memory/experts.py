"""Mixtures of experts (transformers' `grouped_mm_experts_forward`, frozen expert stacks): what the router,
the routed experts and Qwen2-MoE's shared expert keep per token, and the experts' forward / backward moments.
"""

from __future__ import annotations

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import (
    FWD_TOKEN_STATS_BYTES,
    GRANITE_BESIDE_H,
    MOE_BWD_HEAD_FREED,
    MOE_BWD_INDEX_BYTES,
    MOE_BWD_UP_I,
    MOE_BWD_UP_I_CKPT,
    MOE_FWD_BESIDE_CKPT,
    MOE_FWD_BESIDE_NO_CKPT,
    MOE_FWD_INDEX_BYTES,
    MOE_INDEX_BYTES,
    NORM_BWD_BYTES_PER_H,
    SHARED_BESIDE_H,
    SHARED_GATE_KEPT_H,
)
from lowmem_ft.memory.families import family
from lowmem_ft.memory.records import DTYPE_BYTES, Setup
from lowmem_ft.memory.savers import RECOMPUTE_LORA


def moe_router_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what the router keeps (see MOE_INDEX_BYTES)."""
    moe = arch.moe
    assert moe is not None
    probs = 4 * (moe.top_k if moe.routing == "topk_softmax" else moe.experts)
    renorm = 4 * moe.top_k + 4 if moe.routing.startswith("fp32_renorm") else 0
    return probs + 8 * moe.top_k + renorm


def moe_routed_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what the routed experts keep with frozen weights: per routed copy the indices, c·2I, c·I, c·h and
    the routing weight (see MOE_INDEX_BYTES)."""
    moe = arch.moe
    assert moe is not None
    c = DTYPE_BYTES[s.compute_dtype]
    weight = 4 if moe.routing == "fp32_renorm" else c
    per_copy = MOE_INDEX_BYTES + 3 * c * moe.intermediate_size + c * arch.hidden_size + weight
    return moe.top_k * per_copy


def moe_activation_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what one MoE block keeps for backward: the shared expert's (Qwen2-MoE: a dense gated MLP with its
    LoRA inputs, as `mlp_activation_bytes`), the router's and the routed experts' (measured, see MOE_INDEX_BYTES)."""
    moe = arch.moe
    assert moe is not None
    c = DTYPE_BYTES[s.compute_dtype]
    shared = 0.0
    if moe.shared_intermediate:
        shared = 3 * c * moe.shared_intermediate + (
            0 if s.adapter == "full" else RECOMPUTE_LORA.lora_inputs(arch, s, mlp=True)
        )
        shared += SHARED_GATE_KEPT_H * c * arch.hidden_size + 2 * c
    return shared + moe_router_bytes(arch, s) + moe_routed_bytes(arch, s)


def _moe_widths(arch: Architecture, s: Setup) -> tuple[int, int, int, int, int]:
    """(k, h, I, c, w) of the experts' terms."""
    moe = arch.moe
    assert moe is not None
    c = DTYPE_BYTES[s.compute_dtype]
    return moe.top_k, arch.hidden_size, moe.intermediate_size, c, (4 if moe.routing == "fp32_renorm" else c)


def moe_eval_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, the routed experts' tensors in flight without autograd (evaluation): their forward moment as
    under checkpointing, where nothing is kept either (read from the same attribution), beside the shared expert's
    output (Qwen2-MoE), which runs first (modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock.forward): its own MLP's
    tensors are freed by then, its moment is `evaluation.eval_mlp_bytes`'. Traced on Qwen1.5-MoE-A2.7B's 40 GB plan
    (eval 16 × 2,048) cut to two layers: 2,829 MB in flight at this moment against 2,845 predicted; counting the
    shared MLP's 3·c·i beside it over-predicted that eval by 868 MB (+13 %)."""
    k, h, i, c, w = _moe_widths(arch, s)
    moment = max(k * c * (h + 4 * i), k * h * (2 * c + 2 * w)) + k * MOE_FWD_INDEX_BYTES + c * arch.moe.experts
    return moment + (c * h if arch.moe.shared_intermediate else 0)


def moe_forward_transient_bytes(arch: Architecture, s: Setup) -> float:
    """The experts' forward moment beyond what the layers keep (see MOE_FWD_INDEX_BYTES)."""
    k, h, i, c, w = _moe_widths(arch, s)
    logits = c * arch.moe.experts
    if s.gradient_checkpointing:
        moment = max(k * c * (h + 4 * i), k * h * (2 * c + 2 * w)) + k * MOE_FWD_INDEX_BYTES
        beside = MOE_FWD_BESIDE_CKPT
    else:
        moment = max(k * h * (c + 2 * w), k * c * i) + k * MOE_FWD_INDEX_BYTES // 2
        beside = MOE_FWD_BESIDE_NO_CKPT
    beside += _moe_extra_beside(arch, s)
    return (moment + logits + beside * c * h + FWD_TOKEN_STATS_BYTES) * s.tokens


def _moe_extra_beside(arch: Architecture, s: Setup) -> int:
    """Hidden-sized tensors beside the experts' forward moments in some families under checkpointing
    (SHARED_BESIDE_H, GRANITE_BESIDE_H; without it the shared expert's output is among the kept tensors)."""
    if not s.gradient_checkpointing:
        return 0
    extra = SHARED_BESIDE_H if arch.moe and arch.moe.shared_intermediate else 0
    return extra + (GRANITE_BESIDE_H if family(arch.model_type).scaled_embeddings_kept else 0)


def unused_sliding_mask_bytes(arch: Architecture, s: Setup) -> float:
    """Qwen2-MoE's forward builds a sliding-window mask even when no layer uses it (modeling_qwen2_moe.py always
    calls `create_sliding_window_causal_mask`, and with `use_sliding_window` false the config's window is 0, which
    no sequence can skip): a bool b × s × s alive through the layers' forward, freed before the head (measured: the
    layers' forward window was s B/token short at 512 and 1,024 tokens, devkit/harness/moe.py)."""
    if not family(arch.model_type).unused_sliding_mask or arch.sliding_layers or s.attn_implementation != "sdpa":
        return 0.0
    return float(s.micro_batch_size * s.max_seq_len**2)


def moe_backward_transient_bytes(arch: Architecture, s: Setup) -> tuple[float, str]:
    """Gradients in flight at the experts' backward peak (see MOE_FWD_INDEX_BYTES): beside the recomputed layer with
    checkpointing; without, beside every kept tensor, or the final norm's fp32 backward when that is larger."""
    k, h, i, c, w = _moe_widths(arch, s)
    unpermute = k * h * (c + 2 * w)
    if s.gradient_checkpointing:
        grads = max(unpermute, k * (c * MOE_BWD_UP_I_CKPT * i - w * h)) + k * MOE_BWD_INDEX_BYTES
        grads += (GRANITE_BESIDE_H * c * h) if family(arch.model_type).scaled_embeddings_kept else 0
        return grads * s.tokens, "recomputed experts' gradients (measured)"
    grads = max(NORM_BWD_BYTES_PER_H * h, max(unpermute, MOE_BWD_UP_I * k * c * i) - MOE_BWD_HEAD_FREED * c * h)
    grads += SHARED_BESIDE_H * c * h if arch.moe.shared_intermediate else 0
    return grads * s.tokens, "experts' gradients or the final RMSNorm backward (measured)"
