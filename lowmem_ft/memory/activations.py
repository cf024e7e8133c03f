"""What one decoder layer and the head keep for backward, per token: norms (RMSNorm, Cohere's centred
LayerNorm, q/k norms), the linears' inputs, the attention (SDPA, eager scores, explicit masks), the MLP (gated, plain,
xIELU), the first layer's discount, the final norm and loss input; and how the layers' terms add up with and without
checkpointing (`_activations`). What a saver changes in them is its own (`lowmem_ft.memory.savers`).
"""

from __future__ import annotations

from lowmem_ft.memory import dora
from lowmem_ft.memory.arch import Architecture, Linear
from lowmem_ft.memory.calibration import (
    CENTRED_NORM_EXTRA_FP32,
    CHUNKED_LABEL_BYTES,
    CHUNKED_POSITION_BYTES,
    EAGER_SOFTMAX_BESIDE_KV,
    EAGER_SOFTMAX_BESIDE_Q,
    EAGER_SOFTMAX_BWD_FP32,
    EAGER_SOFTMAX_FP32,
    TOKEN_BOOKKEEPING_BYTES,
    XIELU_KEPT_BOOL,
    XIELU_KEPT_C,
    XIELU_KEPT_C_TRAINED,
)
from lowmem_ft.memory.experts import moe_activation_bytes
from lowmem_ft.memory.families import family, with_flag
from lowmem_ft.memory.linears import (
    ATTENTION_INPUT_LINEARS,
    dropout_mask_bytes,
    fused_qkv,
    lora_linears,
    peft_lora_input_bytes,
)
from lowmem_ft.memory.records import DTYPE_BYTES, Component, Setup
from lowmem_ft.memory.savers import RECOMPUTE_LORA, TILED_MLP, TILED_NORMS, checkpointed_layers


def mlp_activation_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what one untiled decoder MLP keeps for backward: act(gate) keeps gate (c·i), the product keeps
    act(gate) and up (2·c·i); plus the LoRA inputs of its adapted linears (frozen linears keep nothing)."""
    c = DTYPE_BYTES[s.compute_dtype]
    i = arch.intermediate_size
    acts = (3 * c * i if arch.mlp == "gated" else c * i) + xielu_extra_bytes(arch, s)
    return acts + (0 if s.adapter == "full" else RECOMPUTE_LORA.lora_inputs(arch, s, mlp=True))


def masked_layers(arch: Architecture, s: Setup) -> int:
    """Layers whose SDPA attention is given an explicit mask rather than `is_causal` (transformers 5.24
    masking_utils `_ignore_causal_mask_sdpa`): every layer of a padded batch (micro batch > 1: the collator pads),
    and the sliding-window layers once the sequence reaches the window (`kv_length >= local_attention_size`)."""
    if s.attn_implementation != "sdpa":
        return 0
    if s.micro_batch_size > 1:
        return arch.num_layers
    if arch.sliding_window and s.max_seq_len >= arch.sliding_window:
        return arch.sliding_layers
    return 0


def attention_mask_bytes(arch: Architecture, s: Setup) -> float:
    """The explicit attention masks masking_utils builds once per forward for the masked layers (`masked_layers`):
    bool, b × 1 × s × s, one per kind of layer masked (a padded batch of a model with sliding and full layers gets
    both). Passed to every layer, so alive from the forward to the end of the backward (each checkpoint keeps it).
    Measured (PeakMemory, devkit/harness/long_context.py on the Mistral shape with a 4,096-token window, 8,192 tokens,
    checkpointing): 67 MB the model lacked before, 1 B per element; each masked layer's SDPA adds its c-byte additive
    copy beside it (`layer_activation_bytes`, and the forward transient under checkpointing)."""
    n_masked = masked_layers(arch, s)
    if n_masked == 0:
        return 0.0
    kinds = 2 if s.micro_batch_size > 1 and 0 < arch.sliding_layers < arch.num_layers else 1
    return kinds * s.micro_batch_size * s.max_seq_len**2


def layer_activation_bytes(arch: Architecture, s: Setup, masked: bool | None = None) -> float:
    """Bytes one decoder layer keeps for backward per token, without checkpointing (autograd's saved tensors).

    Read from the modeling code (modeling_llama/qwen2 RMSNorm upcast, RoPE, MLP), torch's autograd formulas (a
    frozen weight makes its op keep no input) and peft lora/layer.py Linear.forward (input cast to fp32, dropout
    mask, lora_A input and output); checked against PeakMemory per layer (1- vs 2-layer models,
    benchmarks/estimator_cpu.md:
    exact for full fine-tuning and, with the CPU dropout mask, for LoRA/QLoRA) and across the zoo's families
    (benchmarks/estimator_zoo.md). `masked`: the layer's SDPA gets an explicit mask (see `masked_layers`; default:
    whether any layer does). The tiled MLP's and the tiled norms' terms are theirs (`savers.TiledMLP.mlp_kept`,
    `savers.TiledNorms.layer_norms`).
    """
    masked = masked_layers(arch, s) > 0 if masked is None else masked
    total = _norm_bytes(arch, s) + _linear_input_bytes(arch, s) + _attention_bytes(arch, s, masked)
    if arch.moe:
        return total + moe_activation_bytes(arch, s)
    # a full fine-tune's MLP linear inputs were counted with the others (`_linear_input_bytes`)
    return total + TILED_MLP.mlp_kept(arch, s, mlp_activation_bytes(arch, s))


def _norm_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what a layer's RMSNorms keep (q/k norms included)."""
    c, h = DTYPE_BYTES[s.compute_dtype], arch.hidden_size
    full = s.adapter == "full"
    # RMSNorm: hidden.to(float32) is kept (pow and mul both need it) + rsqrt per token; with a trainable weight the
    # normalized input of `weight *` is kept too: c bytes (Llama: weight * hidden.to(dtype)), or 4 for Gemma's
    # norm, which multiplies in fp32 (modeling_gemma*.py: output * (1.0 + self.weight.float())).
    normalized = (4 if arch.norm_fp32_output else c) * h if full else 0
    total = TILED_NORMS.layer_norms(arch, s, arch.norms_per_layer * (4 * h + 4 + normalized))
    # q/k RMSNorm over head_dim (Qwen3, Gemma-3): the fp32 upcast of q and k and an rsqrt per head, as any RMSNorm
    # (measured on the zoo's Qwen3 / Gemma-3: benchmarks/estimator_zoo.md); the tiled norms leave them as they are.
    if arch.qk_norm:
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        total += 4 * (q + kv) + 4 * (arch.num_heads + arch.num_kv_heads)
        if full:
            total += (4 if arch.norm_fp32_output else c) * (q + kv)
    return total + centred_norm_extra_bytes(arch, s)


def centred_norm_extra_bytes(arch: Architecture, s: Setup, one_norm: bool = False) -> float:
    """Per token, the second fp32 x − mean copy Cohere's mean-centred LayerNorms keep beyond an RMSNorm's upcast
    (CENTRED_NORM_EXTRA_FP32): the layer's norms (a tiled norm keeps only its input) and q/k norms, or with
    `one_norm` one hidden-sized norm (the final norm, or the first layer's that keeps nothing); 0 for other norms."""
    if arch.norm != "layer_no_bias":
        return 0.0
    norms = TILED_NORMS.centred_norms(s, 1 if one_norm else arch.norms_per_layer)
    width = norms * arch.hidden_size
    if arch.qk_norm and not one_norm:
        width += (arch.num_heads + arch.num_kv_heads) * arch.head_dim
    return CENTRED_NORM_EXTRA_FP32 * width


def xielu_extra_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what Apertus's xIELU activation keeps beyond the c·i input a plain activation keeps (XIELU_KEPT_*);
    0 for other activations."""
    if arch.hidden_act != "xielu":
        return 0.0
    c = DTYPE_BYTES[s.compute_dtype]
    kept_c = XIELU_KEPT_C + (XIELU_KEPT_C_TRAINED if s.adapter == "full" else 0)
    return (kept_c * c + XIELU_KEPT_BOOL) * arch.intermediate_size


def _linear_input_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, the linears' kept inputs outside the attention's and the MLP's own tensors. LoRA: peft's. A full
    fine-tune: a trainable weight keeps its input (c bytes), one tensor per input however many linears read it — the
    attention's norm output (q/k/v, fused or not), the MLP's norm output (gate/up; in a parallel block with one norm,
    Cohere / Phi / Falcon, the attention's), each down-projection's own input — while the attention output
    projection's input is the attention output `_attention_bytes` counts, unless it is a copy (`_o_proj_copies`).

    Grouping by (input width, output side) instead merged the MLP's norm output with the attention's input and let
    o_proj's entry (heads·head_dim wide) stand for it: off by c·(hidden − heads·head_dim) per token and layer where
    they differ (Qwen3, Gemma-2/3, Mistral-Nemo), and by c·heads·head_dim with the tiled MLP. Measured per layer with
    PeakMemory (live after the backbone's forward minus static, 3- minus 2-layer models, bf16, 256 tokens, h 256,
    4 heads; tests/memory/test_estimate.py): Llama with head_dim 96 / 32 kept 12,056 / 10,520 B/token where the
    grouping said 12,312 / 10,264, with the tiled MLP 6,424 where it said 7,192; Phi-3 13,976 / 11,160
    where it said 13,464 / 10,648 (its o_proj reads a copy: `_o_proj_copies`)."""
    if s.adapter != "full":
        return RECOMPUTE_LORA.lora_inputs(arch, s, mlp=False)
    h = arch.hidden_size
    inputs: dict[str, int] = {}
    for lin in arch.linears:
        if _is_attention_output(arch, lin):
            if _o_proj_copies(arch, s):
                inputs["attention output copy"] = lin.in_features
            continue
        if TILED_MLP.tiles(arch, s, lin):
            continue  # the tiled MLP keeps its input itself (`TiledMLP.mlp_kept`)
        if lin.name in ATTENTION_INPUT_LINEARS or lin.name == "query_key_value":
            key = "attention norm"
        elif lin.in_features == h:
            key = "attention norm" if arch.norms_per_layer == 1 else "mlp norm"
        else:
            key = lin.name  # a down-projection reads a tensor of its own
        inputs[key] = lin.in_features
    return DTYPE_BYTES[s.compute_dtype] * sum(inputs.values())


def _is_attention_output(arch: Architecture, lin: Linear) -> bool:
    """The attention's output projection (o_proj; `dense` in GPT-NeoX / Falcon / Phi)."""
    return lin.name in ("o_proj", "dense")


# Families whose apply_rotary_pos_emb joins the rotated and passed-through halves with torch.cat (transformers 5.24
# modeling_phi3 / _glm / _glm4 / _nemotron / _gpt_neox; Phi's attention inline): q comes out (batch, heads, seq,
# head_dim)-contiguous rather than a transposed view, and SDPA returns its output in that order (`Family.rope_cat`).
ROPE_CAT_FAMILIES = with_flag("rope_cat")


def _o_proj_copies(arch: Architecture, s: Setup) -> bool:
    """Whether the output projection's input is a tensor of its own rather than the attention output
    `_attention_bytes` counts. transformers' `attn_output.transpose(1, 2).contiguous()` copies unless the attention
    returned (batch, seq, heads, head_dim) memory order, which it does not for eager attention (its value matmul
    returns (batch, heads, seq, head_dim)) nor for the ROPE_CAT_FAMILIES' queries. Traced on the CPU (does o_proj
    read the SDPA kernel's output storage?): yes for Llama, Qwen3, Cohere, StarCoder2; no for Phi-3, Phi, GLM,
    GLM-4, Nemotron, GPT-NeoX. Measured on Phi-3 (above) and the zoo's Gemma-2 (eager, h 256, 4 × 96, full:
    26,144 B/token kept with its 8,192 of scores, where the grouping, with `_attention_bytes` counting an eager
    output, said 26,400). CUDA's kernels are taken to order their output as the CPU's does (not measured: counting
    the copy is the safe side)."""
    return s.attn_implementation == "eager" or family(arch.model_type).rope_cat


def _attention_bytes(arch: Architecture, s: Setup, masked: bool) -> float:
    """Per token, what a layer's attention keeps (its s² eager scores are a term of their own).

    SDPA flash/efficient, or flash_attention_2: q, k, v, output (c bytes) + fp32 logsumexp per head. With an
    explicit mask (padding, or a sliding window the sequence reaches) transformers repeats k/v to all heads
    (sdpa_attention.py repeat_kv, `use_gqa_in_sdpa` needs mask None) and torch's SDPA converts the bool mask to a
    c-byte additive mask (b × 1 × s × s) that each layer's attention keeps: s·c per token (measured 256 B/token at
    s 128, bf16). Eager attention always repeats k/v (eager_attention_forward)."""
    c = DTYPE_BYTES[s.compute_dtype]
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    repeated = (masked or s.attn_implementation == "eager") and repeats_kv_copy(arch)
    kv_kept = q if repeated else kv
    # a fused projection (Phi-3 qkv_proj) hands SDPA views of its one output: v keeps all of it alive unless
    # repeat_kv copies it (traced on Phi-3-mini, 32 of 32 heads, a padded 2 × 2,048 batch cut to one and two
    # layers: each layer keeps qkv_proj's c·(q + 2·kv) output beside the rotated q and k, 12,288 B/token above
    # counting v one head-set wide, the whole of the 40 GB row's −3.5 %)
    v_kept = q + 2 * kv if fused_qkv(arch) and not repeated else kv_kept
    # eager attention's value matmul keeps its inputs, not its output (o_proj's input there is a copy a trained
    # o_proj keeps: `_o_proj_copies`); measured on the zoo's Gemma-2 shape (h 256, 4 × 96, LoRA): 38,016 B/token per
    # layer with its scores, where counting an output said 38,784
    out = 0 if s.attn_implementation == "eager" else q
    return c * (q + out + kv_kept + v_kept) + 4 * arch.num_heads + (c * s.max_seq_len if masked else 0)


def repeats_kv_copy(arch: Architecture) -> bool:
    """Whether transformers' `repeat_kv` (sdpa_attention.py, eager_attention_forward) copies k and v to every head,
    so that attention keeps copies of its own rather than the projections' outputs. Not with one key/value head
    (multi-query: Gemma-3-1B, Falcon): `expand(...).reshape(...)` merges a size-1 dimension with the expanded one,
    which is a view. Traced on gemma-3-1b-pt (1 of 4 heads, a padded batch: every layer masked) at 2 × 2,048
    tokens cut to two layers, located by stack: each layer keeps k and v unrepeated; counting copies over-predicted
    the forward by 3,072 B/token per layer (+334 MB, +1.4 %, at 26 layers). Not with as many key/value heads as
    heads either: `repeat_kv` returns its input (`n_rep == 1`), which matters where k and v are views of a fused
    projection's output (`_attention_bytes`: Phi-3's v keeps all of qkv_proj's output)."""
    return 1 < arch.num_kv_heads < arch.num_heads


def first_layer_discount(arch: Architecture, s: Setup) -> float:
    """Per token, what the first layer does not keep when its input needs no gradient (LoRA without checkpointing:
    frozen embeddings, and `enable_input_require_grads` is only set for checkpointing): the input RMSNorm's fp32
    upcast and rsqrt, and the dropout masks of the attention input projections (`input * noise` keeps the noise
    only for an input that requires grad). Measured: 8203 B/token less for h 512 (= 4·512 + 4 + 3·4·512 + 7)."""
    if s.adapter == "full" or s.gradient_checkpointing:
        return 0.0
    h = arch.hidden_size
    drop = RECOMPUTE_LORA.first_layer_masks(s, dropout_mask_bytes(s))
    attn_in = sum(lin.in_features for lin in lora_linears(arch, s) if lin.name in ATTENTION_INPUT_LINEARS)
    attn_in += parallel_block_inputs(arch, s)
    # a tiled norm keeps its c-byte input only when it needs grad
    norm = TILED_NORMS.one_norm(arch, s, 4 * h + 4)
    return norm + centred_norm_extra_bytes(arch, s, one_norm=True) + drop * attn_in


def parallel_block_inputs(arch: Architecture, s: Setup) -> int:
    """A parallel block (Cohere: attention and MLP on one `input_layernorm`, the only family with one norm per
    layer) feeds its MLP's input linears the attention's input: per token, their LoRA input widths, whose dropout
    masks the first layer does not keep either (`first_layer_discount`). A full fine-tune's MLP keeps that same norm output
    (`_linear_input_bytes`), not a norm output of its own as a sequential block's does. Measured per layer with PeakMemory (2- vs 3-layer Cohere h 256 models, full fine-tune, 256
    tokens): 15,414 B/token kept, 15,916 with a second norm output; LoRA without checkpointing 0.5 % over the harness's
    peak with the first layer's gate/up masks counted (`python -m devkit.bench.estimator --blocks`)."""
    if arch.norms_per_layer != 1:
        return 0
    return sum(lin.in_features for lin in lora_linears(arch, s) if lin.name in ("gate_proj", "up_proj"))


def head_saved_bytes(arch: Architecture, s: Setup, eval_only: bool = False) -> float:
    """Per token, kept from the end of forward to the loss's backward: the final RMSNorm (fp32 upcast, rsqrt, and
    its normalized input when trained), the loss input (the fused head's `hidden_states[:, :-1]` is reshaped — a
    c-byte copy — on the CPU, and gathered `hidden_states[mask]` on CUDA), RoPE cos/sin and bookkeeping.
    `eval_only`: the loss input alone — without autograd the norm keeps nothing and RoPE's tables die with the
    model's forward (the fused head's eval peak: the norm's output and this copy, 2·c·h, traced on Llama-3.1-8B to
    within 0.05 MB of 8,192 tokens' worth); none where the fused head scores a view of the norm's output
    (`head_input_copied`: one row on the CPU; traced on Mistral-7B-v0.3's long 8 GB plan, eval 1 × 16,384, cut to
    two layers: the head's eval moment holds one c·h, 134.2 MB under the memory model's two)."""
    c = DTYPE_BYTES[s.compute_dtype]
    h = arch.hidden_size
    norm = TILED_NORMS.one_norm(arch, s, 4 * h + 4 + (c * h if s.adapter == "full" else 0))
    norm += centred_norm_extra_bytes(arch, s, one_norm=True)
    # TRL's fused head and the chunked loss both keep a c-byte copy of the hidden states they project (reshape /
    # `hidden[mask]`); the full-logits loss keeps lm_head's input itself, the final norm's output. The chunked loss's
    # copy and per-label tensors are per labelled position: spread here over every position (× their fraction).
    loss_input = c * h if s.loss_impl in ("trl_fused", "trl_fused_logps") else 0
    if s.loss_impl == "chunked":
        labelled = s.tokens if s.loss_tokens is None else min(s.loss_tokens, s.tokens)
        loss_input = (c * h + CHUNKED_LABEL_BYTES) * labelled / max(1, s.tokens) + CHUNKED_POSITION_BYTES
    if eval_only:
        fused_view = s.loss_impl in ("trl_fused", "trl_fused_logps") and not head_input_copied(s)
        return 0 if fused_view else loss_input
    return norm + loss_input + 2 * c * arch.head_dim + TOKEN_BOOKKEEPING_BYTES


def head_input_copied(s: Setup) -> bool:
    """Whether TRL's fused head scores a copy of the final norm's output, so that the output itself (the backbone's
    `last_hidden_state`) is alive beside the copy through the loss's forward: `hidden_states[mask]` where Triton runs
    (CUDA), and on the CPU `hidden_states[:, :-1].reshape(-1, h)`, a copy for a batch of several rows and a view for
    one (trl 1.16 trainer/utils.py `_fused_forward`, kernels/chunked_logprob.py `_use_triton`). Traced on
    Phi-3-mini-4k cut to one layer, 4 x 2,048, located by stack: the norm's c-byte output (50.3 MB) beside the
    copy at the head's forward peak, where the memory model fell 47.6 MB short; Llama-3.2-1B at 1 x 2,048: a view,
    exact without it. Measured too (`python -m devkit.bench.estimator --zoo`, real CPU steps): the forward cells of
    the checkpointed 2- and 3-row points of the Llama-3 and Mistral shapes were 0.1 MB under, now equal."""
    return s.loss_impl in ("trl_fused", "trl_fused_logps") and (s.device != "cpu" or s.micro_batch_size > 1)


def eager_scores_bytes(arch: Architecture, s: Setup) -> float:
    """Per layer, the b·heads·s² scores eager attention keeps (modeling_*.py eager_attention_forward): the softmax's
    fp32 output (`softmax(..., dtype=float32)` saves it) and the c-byte probabilities the value matmul keeps; with
    attention softcapping (Gemma-2) also tanh's c-byte output. Measured on the zoo's Gemma-2
    (benchmarks/estimator_zoo.md)."""
    c = DTYPE_BYTES[s.compute_dtype]
    per_score = 4 + c + (c if arch.attn_logit_softcapping else 0)
    return per_score * arch.num_heads * s.micro_batch_size * s.max_seq_len**2


def _scores(arch: Architecture, s: Setup) -> int:
    """b · heads · s²: the attention scores of one layer."""
    return arch.num_heads * s.micro_batch_size * s.max_seq_len**2


def eager_softmax_bytes(arch: Architecture, s: Setup) -> float:
    """Eager attention's softmax moment when nothing is kept (evaluation, a checkpointed layer's forward), beyond
    the layer's input: the c-byte scores, their fp32 upcast (none when c is 4) and fp32 output, beside the normed
    input, q and k/v repeated to every head and unrepeated (calibration.EAGER_SOFTMAX_*)."""
    c = DTYPE_BYTES[s.compute_dtype]
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_score = c + 4 * (EAGER_SOFTMAX_FP32 if c < 4 else EAGER_SOFTMAX_FP32 - 1)
    beside = c * (arch.hidden_size + EAGER_SOFTMAX_BESIDE_Q * q + EAGER_SOFTMAX_BESIDE_KV * kv)
    return per_score * _scores(arch, s) + beside * s.tokens


def eager_probs_bytes(arch: Architecture, s: Setup) -> float:
    """The c-byte attention probabilities an eager decoder layer holds until it returns (`hidden_states, _ =
    self.self_attn(...)`): beside its MLP's forward moment when nothing is kept (calibration.EAGER_SOFTMAX_*)."""
    return DTYPE_BYTES[s.compute_dtype] * _scores(arch, s) if s.attn_implementation == "eager" else 0.0


def eager_masks_bytes(arch: Architecture, s: Setup) -> float:
    """The c-byte additive masks (b × 1 × s × s) masking_utils builds for eager attention once per forward, one per
    kind of layer (Gemma-2's full and sliding): the checkpointed layers' inputs, alive until the backward ends."""
    if s.attn_implementation != "eager":
        return 0.0
    kinds = (arch.sliding_layers > 0) + (arch.sliding_layers < arch.num_layers)
    return DTYPE_BYTES[s.compute_dtype] * kinds * s.micro_batch_size * s.max_seq_len**2


def eager_softmax_backward_bytes(arch: Architecture, s: Setup) -> float:
    """Under checkpointing, the recomputed eager layer's softmax backward beyond the checkpointed inputs (0 otherwise):
    per score the softmax's saved fp32 output, the incoming gradient's fp32 upcast and the fp32 result
    (EAGER_SOFTMAX_BWD_FP32; the c-byte probabilities and their gradient are freed by then) and tanh's c-byte output
    with softcapping; the eager masks; per token what the layer saved before its attention — the input norm's fp32
    upcast and rsqrt, the q/k/v LoRA inputs, q with k and v repeated (`_attention_bytes`; the gradient of v stands
    in for v) — the residual stream's c-byte gradient and RoPE's cos/sin. The MLP's tensors and the head's are
    freed by then (calibration.EAGER_SOFTMAX_BWD_FP32)."""
    if not (s.gradient_checkpointing and s.attn_implementation == "eager"):
        return 0.0
    c, h = DTYPE_BYTES[s.compute_dtype], arch.hidden_size
    per_score = 4 * EAGER_SOFTMAX_BWD_FP32 + (c if arch.attn_logit_softcapping else 0)
    lins = [lin for lin in lora_linears(arch, s) if lin.name in ATTENTION_INPUT_LINEARS]
    if s.adapter == "full":
        inputs = c * h
    elif RECOMPUTE_LORA.on(s):
        inputs = RECOMPUTE_LORA.kept_inputs(arch, s, lins)
    else:
        inputs = peft_lora_input_bytes(arch, s, lins, dropout_mask_bytes(s))
    per_token = 4 * h + 4 + inputs + _attention_bytes(arch, s, False) + c * h + 2 * c * arch.head_dim
    return per_score * _scores(arch, s) + eager_masks_bytes(arch, s) + per_token * s.tokens


def _activations(arch: Architecture, s: Setup, comps: list[Component]) -> tuple[float, float]:
    """(kept for backward, one layer's activations) of the decoder layers, their components appended to `comps`.

    Layers whose attention gets an explicit mask keep more (see `masked_layers`); checkpointing keeps each layer's
    input and recomputes the largest layer (`savers.checkpointed_layers`, offloading included), without it every
    layer's activations are kept; eager attention adds its s² scores to either."""
    t = s.tokens
    n_masked = masked_layers(arch, s)
    layer = layer_activation_bytes(arch, s, masked=n_masked > 0) * t
    mask = attention_mask_bytes(arch, s)
    if mask:
        comps.append(Component("attention masks (s², bool)", mask, "forward/backward", "masking_utils sdpa_mask"))
    all_layers = n_masked * layer + (arch.num_layers - n_masked) * layer_activation_bytes(arch, s, masked=False) * t
    if s.gradient_checkpointing:
        kept = checkpointed_layers(arch, s, comps, layer)
    else:
        kept = all_layers - first_layer_discount(arch, s) * t
        comps.append(Component("activations, all layers", kept, "forward/backward", "autograd saved tensors"))
    norms = dora.kept_per_layer(s, lora_linears(arch, s))
    if norms:  # per layer, not per token: the recomputed layer's with checkpointing, every layer's without
        comps.append(Component("DoRA weight norms (kept)", norms * (1 if s.gradient_checkpointing else arch.num_layers),
                               "forward/backward", "peft dora.py: norm, scale, scale − 1; fp32 weight copies"))  # fmt: skip
        if s.gradient_checkpointing:
            layer += norms
        else:
            kept += norms * arch.num_layers
    if s.attn_implementation == "eager":
        eager = eager_scores_bytes(arch, s) * (1 if s.gradient_checkpointing else arch.num_layers)
        comps.append(Component("eager attention scores (s²)", eager, "forward/backward", "softmax probs kept"))
        if not s.gradient_checkpointing:
            kept += eager
        else:
            layer += eager
    return kept + mask, layer
