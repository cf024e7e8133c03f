"""Peak training memory as named components: pure arithmetic over an `Architecture` (no torch import).

The one idea: the peak of a training step is the static state (weights, trainable parameters, their gradients and
optimizer states) plus the largest of two transient phases — forward/backward (saved activations, the loss's
working set, a dequantization buffer) and the optimizer step (its temporaries) — plus device overheads and the
safety margin. The first micro batch of an optimizer step begins without gradients (the Trainer sets them to
None after each step) and creates them during its backward (`Estimate.first_micro_batch`): with one micro batch
per step that moment, not the steady state, is the peak. Each term is a `Component` that says where its constant
comes from, so the same numbers serve `plan`, the planner, the monitor's "predicted" line and the report.

Conventions: "tokens" = micro_batch × max_seq_len; c = bytes of the compute dtype. Every constant is in
`lowmem_ft.memory.calibration`, which says per constant what it was read from or measured with, and with which
library versions (`lowmem_ft.versions.CHECKED`).

The terms live by concern, and this module composes them (and re-exports their names, which the package, the tests
and the devkit import from here):
- `records`: `Setup`, `Component`, `Estimate`, units; the setup as it runs on an architecture.
- `static`: base weights (quantized or not), adapters, gradients, optimizer states and step temporaries, batches.
- `linears`: which linears LoRA adapts, and what peft's LoRA layers keep per token.
- `activations`: what one decoder layer and the head keep for backward (norms, linears, attention, MLP, masks).
- `transients`: what is in flight at the layers' forward and backward peaks.
- `savers`: what each memory saver (host embeddings, tiled norms, tiled MLP, LoRA recompute, checkpointing and
  offloading) changes at each moment, in one place per saver.
- `loss`: the logits and loss working sets (full logits, the chunked loss, TRL's fused head).
- `experts`: the mixture-of-experts blocks' kept tensors and moments.
- `evaluation`: evaluation forwards (no autograd); generation is `inference`.
- `overheads`: the CUDA context, workspaces and allocator.
- `adapter_init`: PiSSA's / OLoRA's decomposition at start-up, a moment of its own beside the step's peak.
- `families`: what the memory model knows per model family (one record each).
"""

from __future__ import annotations

from typing import Literal

from lowmem_ft.memory import adapter_init, dora
from lowmem_ft.memory.activations import (
    ROPE_CAT_FAMILIES,
    _activations,
    attention_mask_bytes,
    centred_norm_extra_bytes,
    eager_scores_bytes,
    eager_softmax_backward_bytes,
    first_layer_discount,
    head_input_copied,
    head_saved_bytes,
    layer_activation_bytes,
    masked_layers,
    mlp_activation_bytes,
    parallel_block_inputs,
    xielu_extra_bytes,
)
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import (
    BATCH_BYTES_PER_TOKEN,
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    MOE_FWD_INDEX_BYTES,
    NF4_DQ_STATE_BYTES,
    NF4_STATE_BYTES,
    TRL_TOKEN_CHUNK,
)
from lowmem_ft.memory.evaluation import eval_mlp_bytes, eval_peak_bytes
from lowmem_ft.memory.experts import (
    moe_activation_bytes,
    moe_backward_transient_bytes,
    moe_eval_bytes,
    moe_forward_transient_bytes,
    moe_routed_bytes,
    moe_router_bytes,
    unused_sliding_mask_bytes,
)
from lowmem_ft.memory.linears import (
    ATTENTION_INPUT_LINEARS,
    MLP_LINEARS,
    is_mlp_linear,
    lora_linears,
)
from lowmem_ft.memory.loss import (
    chunk_backward_bytes,
    chunk_forward_bytes,
    largest_loss_chunk,
    loss_bytes,
    loss_chunk_tokens,
    loss_positions,
)
from lowmem_ft.memory.overheads import allocator_block, device_overheads, overhead_bytes
from lowmem_ft.memory.recompute import ends_recomputed_forward, head_freed_bytes, recomputed_layer_bytes
from lowmem_ft.memory.records import (
    DTYPE_BYTES,
    GB,
    Component,
    Device,
    Estimate,
    LossImpl,
    Setup,
    effective_setup,
    mlp_tile_tokens,
)
from lowmem_ft.memory.savers import TILED_NORMS
from lowmem_ft.memory.static import (
    BATCH,
    MOE_WEIGHTS_SOURCE,
    _static_components,
    _trainable_tensors,
    optimizer_state_bytes,
    optimizer_step_temp,
    trainer_fp32_states,
    weight_bytes,
)
from lowmem_ft.memory.tower import pixel_component, tower_components, tower_copy_component, tower_moments
from lowmem_ft.memory.transients import (
    attention_forward_bytes,
    backward_transient_bytes,
    final_norm_forward_bytes,
    forward_transient_bytes,
    masked_attention_forward_bytes,
    recompute_forward_transient_bytes,
    tiled_mlp_transient_bytes,
)

# what the package, the tests and the devkit import from here (the terms live in the modules above)
__all__ = [
    "ATTENTION_INPUT_LINEARS",
    "BATCH",
    "BATCH_BYTES_PER_TOKEN",
    "CUBLAS_WORKSPACE_BYTES",
    "CUDA_CONTEXT_BYTES",
    "Component",
    "DTYPE_BYTES",
    "Device",
    "Estimate",
    "GB",
    "LossImpl",
    "MLP_LINEARS",
    "MOE_FWD_INDEX_BYTES",
    "MOE_WEIGHTS_SOURCE",
    "NF4_DQ_STATE_BYTES",
    "NF4_STATE_BYTES",
    "ROPE_CAT_FAMILIES",
    "RunPhase",
    "Setup",
    "TRL_TOKEN_CHUNK",
    "_trainable_tensors",
    "attention_mask_bytes",
    "backward_beside_layers",
    "backward_transient_bytes",
    "centred_norm_extra_bytes",
    "chunk_backward_bytes",
    "chunk_forward_bytes",
    "eager_scores_bytes",
    "eager_softmax_backward_bytes",
    "effective_setup",
    "estimate",
    "eval_mlp_bytes",
    "eval_peak_bytes",
    "final_norm_forward_bytes",
    "first_layer_discount",
    "attention_forward_bytes",
    "forward_transient_bytes",
    "head_input_copied",
    "head_saved_bytes",
    "is_mlp_linear",
    "largest_loss_chunk",
    "layer_activation_bytes",
    "layer_moments",
    "lora_linears",
    "loss_bytes",
    "loss_chunk_tokens",
    "loss_positions",
    "masked_attention_forward_bytes",
    "masked_layers",
    "mlp_activation_bytes",
    "mlp_tile_tokens",
    "moe_activation_bytes",
    "moe_backward_transient_bytes",
    "moe_eval_bytes",
    "moe_forward_transient_bytes",
    "moe_routed_bytes",
    "moe_router_bytes",
    "optimizer_state_bytes",
    "optimizer_step_temp",
    "parallel_block_inputs",
    "phase_peak_bytes",
    "recompute_forward_transient_bytes",
    "tiled_mlp_transient_bytes",
    "trainer_fp32_states",
    "unused_sliding_mask_bytes",
    "weight_bytes",
    "xielu_extra_bytes",
]


def _forward_backward(arch: Architecture, s: Setup, comps: list[Component], trained: int) -> tuple[float, float, float]:
    """Appends the activation, loss and backward components; returns the forward peak, the backward peak and the
    backward's peak of a step's first micro batch, above static. `trained`: the trainable elements."""
    c = DTYPE_BYTES[s.compute_dtype]
    t = s.tokens
    h = arch.hidden_size
    # what the forward keeps for backward (`kept`), then the largest transient on top of it
    kept, layer = _activations(arch, s, comps)
    head = head_saved_bytes(arch, s) * t
    comps.append(Component("final norm + loss input", head, "forward/backward", "RMSNorm upcast, head input, RoPE"))
    kept += head
    loss_fwd, loss_bwd, loss_src = loss_bytes(arch, s)
    comps.append(Component("logits / loss working set", max(loss_fwd, loss_bwd), "forward/backward", loss_src))
    grads_in_flight, bwd_src = backward_transient_bytes(arch, s)
    layer_bwd = layer + grads_in_flight if s.gradient_checkpointing else grads_in_flight
    comps.append(Component("backward gradient buffers", grads_in_flight, "forward/backward", bwd_src))
    dequant = 0.0
    if s.quantization in ("nf4", "int8"):
        dequant = c * max(lin.in_features * lin.out_features for lin in arch.linears)
        comps.append(Component("dequantization buffer", dequant, "forward/backward", "largest linear in 16-bit"))
    # Full fine-tuning: the embedding's dense backward makes a new c-byte V × h gradient beside the accumulated one,
    # and the CPU measurement shows about two such buffers at the end of the backward (embedding_dense_backward).
    embed_bwd = 2 * c * arch.vocab_size * h if s.adapter == "full" else 0.0
    # the chunked loss copies the final norm's output (`hidden[mask]`), which itself stays alive through the loss's
    # forward (the model's `hidden_states`; PeakMemory, tiny-model runs at 4,096 tokens with and without tiled norms)
    head_out = c * h * t if TILED_NORMS.head_output(s) or s.loss_impl == "chunked" or head_input_copied(s) else 0.0
    # The forward peaks in one of three places: the last decoder layer, beside everything the layers keep and RoPE's
    # cos/sin (the final norm, the loss input and the loss's bookkeeping do not exist yet); the final norm
    # (`final_norm_forward_bytes`); the head and loss, beside the head's saved tensors. Measured apart with
    # PeakMemory's window read by a forward pre-hook on the final norm (the layers' peak alone), attributed op by op.
    rope = 2 * c * arch.head_dim * t
    norm_working_set = dora.forward_transient(arch, s, lora_linears(arch, s))  # 0 without DoRA
    if norm_working_set:
        comps.append(Component("DoRA weight-norm working set", norm_working_set, "forward/backward",
                               "peft dora.py get_lora_weight / get_weight_norm, largest adapted linear"))  # fmt: skip
    layer_fwd = rope + max(forward_transient_bytes(arch, s), attention_forward_bytes(arch, s), norm_working_set)
    if s.gradient_checkpointing:  # the recompute in backward computes the norms again (dequantizing, under QLoRA)
        dequant = max(dequant, norm_working_set)
    # image chats: the tower runs first, beside the input embeddings; its outputs live on through the decoder
    tower = tower_moments(arch, s)  # all 0 for a text step
    comps += tower_components(arch, s)
    kept += tower.kept
    at_layers = max(layer_fwd, rope + final_norm_forward_bytes(arch, s)) + tower.in_layers
    fwd_peak = kept - head + max(head + loss_fwd + head_out + tower.at_head, at_layers)
    fwd_peak = max(fwd_peak, tower.working_set)
    # an eager layer's softmax backward, once the head's saved tensors and the recomputed MLP's are freed
    softmax_bwd = eager_softmax_backward_bytes(arch, s)  # 0 without eager attention and checkpointing
    attn_bwd = kept - head + softmax_bwd if softmax_bwd else 0.0
    layer_moment = kept + layer_bwd + dequant
    if ends_recomputed_forward(arch, s):  # the head's backward has freed its saved tensors by then
        layer_moment = kept - head_freed_bytes(arch, s) + layer + recomputed_layer_bytes(arch, s, dequant)
    end = embed_bwd + c * h * t
    bwd_peak = max(kept + loss_bwd, layer_moment, attn_bwd, end)
    fresh = _first_backward(arch, s, comps, trained, kept, loss_bwd, max(layer_moment, attn_bwd), end)
    return fwd_peak, bwd_peak, fresh


def backward_beside_layers(arch: Architecture, est: Estimate) -> float:
    """The backward's peak among its moments other than a decoder layer's (`layer_moments`), static included: the
    loss's backward beside everything kept, an eager layer's softmax backward, the embedding's at the end (as
    `_forward_backward` takes them). FSDP2 holds its head unit there, a layer's units at the layer's moment
    (`sharding.fsdp2_phases`), so the two are priced apart: `est.phases["backward"]` is the larger of them."""
    s = est.setup
    c, t, h = DTYPE_BYTES[s.compute_dtype], s.tokens, arch.hidden_size
    kept, _ = _activations(arch, s, [])
    head = head_saved_bytes(arch, s) * t
    kept += head + tower_moments(arch, s).kept
    softmax_bwd = eager_softmax_backward_bytes(arch, s)
    attn_bwd = kept - head + softmax_bwd if softmax_bwd else 0.0
    end = (2 * c * arch.vocab_size * h if s.adapter == "full" else 0.0) + c * h * t
    return est.phases["static"] + max(kept + loss_bytes(arch, s)[1], attn_bwd, end)


def _first_backward(
    arch: Architecture,
    s: Setup,
    comps: list[Component],
    trained: int,
    kept: float,
    loss_bwd: float,
    layer: float,
    end: float,
) -> float:
    """The backward's peak above the static state less the gradients, when no gradient exists as it begins: the
    first micro batch of an optimizer step. Source: transformers 5.24 trainer.py `_inner_training_loop` calls
    `model.zero_grad()` after each `optimizer.step()`, and torch's `Module.zero_grad(set_to_none=True)` sets every
    gradient to None (so does lowmem-ft's own step, lowmem_ft/train/resilience/trainer.py).

    The gradients then appear as the backward walks down: none at the loss (a trained head's weight gradient is
    part of the loss's working set until it ends), the head's and one decoder layer's at the last layer's backward,
    all but the untied input embedding's at the first layer's, all at the end. The layers' moments rise or fall
    linearly between the last layer and the first (each frees its saved tensors and adds its gradients), so the
    two ends bound them; at the first layer the other layers' saved tensors are freed, counted as (L − 1) / L of
    the layers' total (the first layer keeps less than the mean, so this frees less than it does: an upper bound).
    `layer` and `end`: the layers' moment and the embedding backward's above the static state (`_forward_backward`).

    Measured with PeakMemory on full fine-tunes, every micro-step at full size (tests/devkit/test_harness_estimator.py):
    where the loss's backward sets the peak, exact to the steady state's own 0.2 MB; with checkpointing, marks at
    each layer's backward rose by one layer's gradients less its checkpointed input per layer, as counted here
    (that run's steady layer moment itself is 20 MB over the measured one, so its bound is too)."""
    by = {x.name: x.bytes for x in comps}
    grads = by["gradients"]
    if not grads:
        return max(kept + loss_bwd, layer, end)
    elem = grads / trained if trained else 0.0
    vh = arch.vocab_size * arch.hidden_size
    head = elem * vh if s.adapter == "full" else 0.0  # the LM head's weight (the tied embedding's, tied)
    embed = elem * vh if s.adapter == "full" and not arch.tie_embeddings else 0.0  # written by the last op
    per_layer = (grads - head - embed) / arch.num_layers
    layers_kept = by.get("activations, all layers", 0.0)
    last_layer = layer + head + per_layer
    first_layer = layer + grads - embed - layers_kept * (arch.num_layers - 1) / arch.num_layers
    return max(kept + loss_bwd, last_layer, first_layer, end + grads)


def estimate(arch: Architecture, s: Setup) -> Estimate:
    """Named components of the peak, and the peak itself (see the module docstring for how they combine)."""
    s, attention_note = effective_setup(arch, s)
    comps, notes, trained = _static_components(arch, s)
    for extra in (pixel_component(arch, s), tower_copy_component(arch, s)):  # image chats (memory.tower)
        if extra is not None:
            comps.append(extra)
    if attention_note:
        notes.insert(0, f"attention: {attention_note}")
    static = sum(x.bytes for x in comps if x.phase == "static")
    fwd_peak, bwd_peak, fresh_bwd = _forward_backward(arch, s, comps, trained.numel)
    fwd_bwd = max(fwd_peak, bwd_peak)

    step_temp = trained.step_temp
    comps.append(Component("optimizer step temporaries", step_temp, "optimizer step", trained.step_source))

    phases = {"static": static, "forward": static + fwd_peak, "backward": static + bwd_peak}
    phases["optimizer step"] = static + step_temp
    # the first micro batch of an optimizer step runs without gradients (module docstring)
    grads = sum(x.bytes for x in comps if x.name == "gradients")
    first = {"forward": static - grads + fwd_peak, "backward": static - grads + fresh_bwd}
    # One micro batch per step: every micro batch is a first one, so the steady state never holds a whole step's
    # gradients beside the activations. Several: the later micro batches accumulate into them, and do.
    fwd_bwd_peak = max(first.values()) if s.gradient_accumulation == 1 else static + fwd_bwd
    model_peak = max(fwd_bwd_peak, phases["optimizer step"])
    phase = "forward/backward" if fwd_bwd_peak >= phases["optimizer step"] else "optimizer step"
    if phase == "forward/backward" and model_peak < static + fwd_bwd:  # the components sum to more than the peak
        absent = static + fwd_bwd - model_peak
        notes.append(
            f"gradients: {absent / GB:.2f} GB of them do not exist at the peak (one micro batch per step: the "
            "Trainer sets them to None after each step, and the backward's peak comes before it creates them)"
        )
    # PiSSA / OLoRA: a moment of its own, once before step 1, beside the step's peak (which it does not change)
    if init := adapter_init.startup_component(arch, s):
        comps.append(init)
        w_lin, w_rest, _ = weight_bytes(arch, s)  # at start-up the whole model is on the device (savers come later)
        phases["start-up"] = adapter_init.startup_bytes(w_lin + w_rest, trained.numel, s, init)
    block = allocator_block(arch, s)
    overheads = device_overheads(s, max(fwd_bwd, step_temp), grads, block=block)
    comps += overheads
    return Estimate(comps, s, model_peak, overhead_bytes(overheads), phase, notes, phases, first, block)


# -- the phases of a real run (the CPU monitor's prediction) ------------------------------------------------------
RunPhase = Literal["forward", "backward", "optimizer step", "eval"]


def phase_peak_bytes(
    arch: Architecture, s: Setup, phase: RunPhase, *, grads: bool = True, states: bool = True, ddp: bool = False
) -> float:
    """Live tensor bytes at the peak of one phase of a training run, for a batch of `s.micro_batch_size` rows ×
    `s.max_seq_len` tokens: what the monitor's exact CPU measurement (`lowmem_ft.train.measure.exact`) is compared with.

    `estimate`'s `phases` are the steady state of an accumulating step, where every static component is alive in
    every phase. A real run is not always there: transformers' Trainer frees the gradients after each optimizer
    step (`model.zero_grad()`, set to None), so the first micro batch of each optimizer step runs without them
    (`grads=False`: its forward has none, its backward creates them as it goes, `Estimate.first_micro_batch`), and
    the optimizer creates its states in its first step (`states=False` before it). `eval` is `eval_peak_bytes` (no
    gradients). `ddp`: one process of several, whose
    gradients lowmem-ft's trainer averages with one flat all-reduce before the optimizer step
    (`lowmem_ft.train.resilience.trainer` `_average_gradients`: a flat copy of every gradient, freed before the step). The CPU
    form only (`s.device == "cpu"`): on CUDA the same phases carry device overheads the monitor reads from the
    allocator instead.
    """
    if s.device != "cpu":
        raise ValueError("phase_peak_bytes is the CPU form (live tensor bytes, no device overheads)")
    est = estimate(arch, s)
    absent = 0.0
    if not states:
        absent += sum(c.bytes for c in est.components if c.name.startswith("optimizer states"))
    if phase == "eval":
        return eval_peak_bytes(arch, s, s.micro_batch_size) - absent
    gradients = est.by_name()["gradients"]
    if not grads and phase == "forward":
        absent += gradients
    elif not grads and phase == "backward":
        return est.first_micro_batch[phase] - absent
    if ddp and phase == "optimizer step":
        return max(est.phases[phase], est.phases["static"] + gradients) - absent
    return est.phases[phase] - absent


def layer_moments(arch: Architecture, est: Estimate) -> tuple[float, float]:
    """(forward, backward) live bytes at the decoder layers' own peaks, static included: the moments the estimate's
    forward and backward peaks take the larger of with the head's and the loss's (`_forward_backward`). For the
    harnesses that measure the layers' windows apart (devkit/harness/moe.py)."""
    arch_s = est.setup
    c, t = DTYPE_BYTES[arch_s.compute_dtype], arch_s.tokens
    kept, layer = _activations(arch, arch_s, [])
    head = head_saved_bytes(arch, arch_s) * t
    rope = 2 * c * arch.head_dim * t
    layer_fwd = rope + max(forward_transient_bytes(arch, arch_s), attention_forward_bytes(arch, arch_s))
    grads, _ = backward_transient_bytes(arch, arch_s)
    dequant = (
        c * max(lin.in_features * lin.out_features for lin in arch.linears) if arch_s.quantization != "none" else 0
    )
    layer_bwd = layer + grads + dequant if arch_s.gradient_checkpointing else grads
    if ends_recomputed_forward(arch, arch_s):
        layer_bwd = layer + recomputed_layer_bytes(arch, arch_s, dequant) - head_freed_bytes(arch, arch_s)
    static = est.phases["static"]
    return static + kept + layer_fwd, static + kept + head + layer_bwd
