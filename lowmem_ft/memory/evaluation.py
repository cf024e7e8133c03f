"""Evaluation forwards during training (no autograd): the MLP's tensors in flight and the peak of one
evaluation batch. Generation after training is `lowmem_ft.memory.inference`.
"""

from __future__ import annotations

from dataclasses import replace

from lowmem_ft.memory.activations import (
    attention_mask_bytes,
    eager_probs_bytes,
    eager_softmax_bytes,
    head_saved_bytes,
    masked_layers,
    repeats_kv_copy,
)
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import BATCH_BYTES_PER_TOKEN, GRPO_PREFILL_HIDDEN
from lowmem_ft.memory.experts import moe_eval_bytes, unused_sliding_mask_bytes
from lowmem_ft.memory.linears import fused_qkv, lora_linears
from lowmem_ft.memory.loss import loss_bytes
from lowmem_ft.memory.overheads import allocator_block, device_overheads, overhead_bytes
from lowmem_ft.memory.records import DTYPE_BYTES, Setup, effective_setup
from lowmem_ft.memory.savers import TILED_MLP
from lowmem_ft.memory.static import _static_components

MLP_INPUT_LINEARS = {"gate_proj", "up_proj", "gate_up_proj", "fc1", "c_fc", "w1", "w3"}  # fed by the MLP's norm
OUTPUT_LINEARS = {"o_proj", "dense", "out_proj", "c_proj", "wo"}  # the attention's output projection


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
    adapted = {lin.name for lin in lora_linears(arch, s)} if s.adapter == "lora" else set()
    if arch.moe:  # the routed experts, or before them the shared expert's dense MLP (Qwen2-MoE)
        return max(moe_eval_bytes(arch, s), _shared_expert_eval_bytes(arch, s, adapted))
    if "gate_up_proj" in adapted:
        return (2 * c + 16) * i
    if arch.mlp == "gated":
        return (2 * c + 8) * i if "up_proj" in adapted else 3 * c * i
    return (c + 8) * i if adapted & {"up_proj", "fc1", "c_fc"} else 2 * c * i


def _shared_expert_eval_bytes(arch: Architecture, s: Setup, adapted: set[str]) -> float:
    """Per token, a shared expert's gated MLP in flight (its linears are `arch.linears`' MLP ones), as a dense
    one's, with peft's fp32 cast of its input (4·h) when LoRA adapts it. Traced on Qwen1.5-MoE-A2.7B's 40 GB plan
    (LoRA, eval 16 × 2,048) cut to two layers, each live storage named by the op that made it: the eval peak is
    up_proj's LoRA output in the shared expert, (2·c + 8)·i + 4·h beside four c·h tensors and the two bool masks,
    3,155 MB of the 3,161 in flight."""
    assert arch.moe is not None
    i, c = arch.moe.shared_intermediate, DTYPE_BYTES[s.compute_dtype]
    if not i:
        return 0.0
    if "up_proj" in adapted:
        return (2 * c + 8) * i + (4 * arch.hidden_size if adapted & MLP_INPUT_LINEARS else 0)
    return 3 * c * i


def eval_mlp_lora_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, the part of `eval_mlp_bytes` that is peft's LoRA branch (lora_B's fp32 output and its scaled copy,
    8 B per output element): what a quantized linear's base matmul does not see beside its dequantized weight."""
    if arch.moe or s.adapter != "lora":
        return 0.0
    adapted = {lin.name for lin in lora_linears(arch, s)}
    i = arch.intermediate_size
    if "gate_up_proj" in adapted:
        return 16.0 * i
    return 8.0 * i if adapted & ({"up_proj"} if arch.mlp == "gated" else {"up_proj", "fc1", "c_fc"}) else 0.0


def eval_layer_bytes(arch: Architecture, s: Setup, dequant: float = 0.0) -> float:
    """One decoder layer's tensors in flight without autograd, at the larger of its two moments (bytes, for
    `s.tokens` tokens). Traced at full size (`lowmem_ft.train.trace.step`, the eval forward of Llama-3.1-8B's and
    gemma-2-9b's 24 GB plans, the peak located by stack): the training layer's saved tensors, the bound used before,
    over-predicted the Llama-3.1-8B eval by 0.86 GB (+3.0 %) and counted no eager scores at all (gemma-2-9b's eval
    at 16 × 2,048 has 10.7 GB of them in flight).

    MLP: its tensors in flight (`eval_mlp_bytes`, one tile's tokens when tiled) and, with LoRA on its input linears,
    peft's fp32 cast of the normed input (4·h), beside the layer input, the residual and the normed input (3·c·h)
    and RoPE's cos/sin: 213,504 B/token predicted, 213,504 + ~1.7 kB of ids and masks traced (Llama-3.1-8B). The
    same moment as GRPO's prefill (calibration.GRPO_PREFILL_HIDDEN). Attention: the output projection (the layer
    input, the normed input, the attention output and its contiguous copy, the base result; with LoRA the fp32 cast
    of its input and lora_B's fp32 output and scaled copy) — 96,256 of 96,386 B/token traced — or, with eager
    attention, the softmax: its c-byte input, fp32 upcast and fp32 output per score (10 B at bf16, 8 at fp32: no
    upcast) beside q, the
    scaled q, k and v repeated to every head and the unrepeated k and v (gemma-2-9b: 10.74 GB of scores and 55.3
    of 55.4 kB/token traced).

    `dequant`: a quantized linear's dequantized weight, in flight beside the linears' moments only. The softmax
    moment has neither it nor a linear running, but past the first layer it has the model's `inputs_embeds` beside
    the layer's input, as the MLP moment has: traced on gemma-2-9b's 24 GB plan (NF4, eval 16 × 2,048) cut to two
    layers, the softmax holds three c·h tensors and no 16-bit weight — predicted 129.5 MB (−0.67 %) under before,
    the one under-prediction the real-size table had."""
    c, h, t = DTYPE_BYTES[s.compute_dtype], arch.hidden_size, s.tokens
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    adapted = {lin.name for lin in lora_linears(arch, s)} if s.adapter == "lora" else set()
    cast = 4 * h if not arch.moe and adapted & MLP_INPUT_LINEARS else 0
    # past the first layer the model's forward still holds `inputs_embeds` (modeling_llama.py LlamaModel.forward):
    # traced on Llama-3.1-8B cut to 1, 2 and 3 layers at 32 x 2,048, the MLP moment holds 3, 4 and 4 c·h tensors
    embeds = 1 if arch.num_layers > 1 else 0
    hidden = (GRPO_PREFILL_HIDDEN + embeds) * c * h + 2 * c * arch.head_dim
    # an eager layer holds its probabilities until it returns (`activations.eager_probs_bytes`)
    tile = TILED_MLP.eval_tokens(arch, s)
    mlp = (eval_mlp_bytes(arch, s) + cast) * tile + hidden * t + eager_probs_bytes(arch, s)
    # the output projection beside `inputs_embeds` past the first layer and RoPE's cos/sin, as the MLP moment
    o_lora = 4 * q + 8 * h if adapted & OUTPUT_LINEARS else 0
    o_proj = ((3 + embeds) * c * h + 2 * c * q + 2 * c * kv + o_lora + 2 * c * arch.head_dim) * t
    # A quantized linear's dequantized weight lives through its base matmul only (bitsandbytes MatMul4Bit.forward:
    # `linear(A, dequantize_4bit(B, ...))`); peft's LoRA branch runs after it (bnb.py Linear4bit.forward), so the
    # weight and the branch's fp32 tensors are never alive together: each moment is the larger of the two. Traced
    # on Phi-3-mini-4k's long 8 GB plan (NF4, eval 4 × 4,096) cut to two layers: the peak, gate_up_proj's LoRA
    # output, holds no dequantized weight (100.7 MB over before).
    lora_mlp = (eval_mlp_lora_bytes(arch, s) + cast) * tile
    linears = max(mlp + max(0.0, dequant - lora_mlp), o_proj + max(0.0, dequant - o_lora * t))
    if s.attn_implementation == "eager":  # the softmax, beside the layer's input (and `inputs_embeds`)
        return max(linears, eager_softmax_bytes(arch, s) + (1 + embeds) * c * h * t)
    return max(linears, eval_masked_sdpa_bytes(arch, s))


def eval_masked_sdpa_bytes(arch: Architecture, s: Setup) -> float:
    """A masked layer's SDPA moment without autograd (`masked_layers`: an eval batch of several rows is padded, so
    every layer is; 0 when none is): torch's SDPA turns the bool mask into a c-byte additive one (b × s × s, alive only
    through the call; the bool mask itself is `attention_mask_bytes`), beside the attention's locals — q and k after
    RoPE, v (with a fused qkv_proj, a view that keeps its whole output), the copies `repeat_kv` makes of k and v
    (sdpa_attention.py: no `enable_gqa` with a mask), SDPA's output and fp32 logsumexp — and the layer input, its
    normed input, `inputs_embeds` past the first layer and RoPE's cos/sin. Traced on Llama-3.2-3B's and
    Qwen2.5-3B's long 8 GB plans (NF4, eval 2 × 16,384) cut to two layers, each live storage named by the op that
    made it: this moment is the eval peak, 2,628.8 / 2,048.9 MB beside the bool mask and the static state, and the
    memory model, which had no such moment, fell 198.8 MB (−4.9 %) short on Llama-3.2-3B."""
    if not masked_layers(arch, s):
        return 0.0
    c, h, t = DTYPE_BYTES[s.compute_dtype], arch.hidden_size, s.tokens
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    v = q + 2 * kv if fused_qkv(arch) else kv
    repeated = 2 * q if repeats_kv_copy(arch) else 0
    embeds = 1 if arch.num_layers > 1 else 0
    per_token = c * (2 * q + kv + v + repeated) + 4 * arch.num_heads + (2 + embeds) * c * h + 2 * c * arch.head_dim
    return c * s.micro_batch_size * s.max_seq_len**2 + per_token * t


def eval_peak_bytes(arch: Architecture, s: Setup, batch: int) -> float:
    """Peak of one evaluation forward during training, overheads included: the eval batch size's memory.

    Evaluation runs under `torch.no_grad()` between optimizer steps, so the static memory is the training one minus
    the gradients (transformers' Trainer zeroes them with `set_to_none`), and nothing is kept for backward: the
    working set is one layer's tensors in flight (bounded by what that layer saves when training — the same
    tensors, created and freed in turn), the residual stream and layer output, the final norm and loss input, and
    the forward of the loss (TRL's fused head also runs in evaluation). The layer and the loss peak one after the
    other, not together; checked against exact CPU measurements of real runs' evaluations (`lowmem_ft.train.measure.exact`).
    """
    s, _ = effective_setup(arch, s)
    train, *_ = _static_components(arch, s)  # what `estimate` counts as static
    static = sum(x.bytes for x in train if x.phase == "static" and x.name != "gradients")
    es = _eval_setup(s, batch)
    c, t = DTYPE_BYTES[s.compute_dtype], es.tokens
    loss_fwd, _, _ = loss_bytes(arch, es)
    dequant = c * max(x.in_features * x.out_features for x in arch.linears) if s.quantization != "none" else 0.0
    # Without autograd nothing outlives its layer: the peak is one layer's tensors in flight (beside the dequantized
    # weight), or later the loss's forward beside the final norm's output and the loss input — never both
    # (measured with the exact CPU count of real runs' evaluations, lowmem_ft.train.measure.exact: summing them
    # over-predicted by up to 25 %).
    layer = eval_layer_bytes(arch, es, dequant)
    head = (c * arch.hidden_size + head_saved_bytes(arch, es, eval_only=True)) * t
    # the bool attention masks are the base model's locals: freed when it returns, before the head runs (traced on
    # Qwen2.5-3B's long 8 GB plan, eval 2 × 16,384, cut to two layers: the head's moment holds no mask); Qwen2-MoE's
    # unused sliding-window mask among them (traced on Qwen1.5-MoE-A2.7B's 40 GB plan, eval 16 × 2,048: both masks)
    masks = attention_mask_bytes(arch, es) + unused_sliding_mask_bytes(arch, es)
    transient = max(layer + masks, head + loss_fwd)
    transient += BATCH_BYTES_PER_TOKEN * t * (2 if s.device == "cpu" else 1)  # the eval batch (+ the loader's next)
    block = allocator_block(arch, es, training=False)
    return static + transient + overhead_bytes(device_overheads(s, transient, block=block))


def _eval_setup(s: Setup, batch: int) -> Setup:
    """An evaluation forward of `batch` rows under training setup `s` (its effective one): no autograd, so nothing
    checkpointed, offloaded or dropped out; an evaluation batch's labelled positions are not known, so every
    position (`loss_tokens` None)."""
    return replace(
        s,
        micro_batch_size=batch,
        gradient_checkpointing=False,
        activation_offloading=False,
        lora_dropout=0.0,
        loss_tokens=None,
    )


def eval_allocator_block(arch: Architecture, s: Setup, batch: int) -> float:
    """The allocator block `eval_peak_bytes` prices an evaluation batch of `batch` rows with (to take it back out)."""
    s, _ = effective_setup(arch, s)
    return allocator_block(arch, _eval_setup(s, batch), training=False)
