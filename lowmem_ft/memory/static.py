"""The static state: base weights (NF4 / int8 / 16-bit), the trainable tensors (LoRA or every parameter), their
gradients and optimizer states, the optimizer step's temporaries, and the batch tensors held through a step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import (
    BATCH_BYTES_PER_TOKEN,
    BNB_BLOCK,
    BNB_MIN_8BIT_SIZE,
    BNB_PAGED_MIN,
    INT8_ROW_SCALE_BYTES,
    NF4_BITS,
    NF4_DQ_BITS,
    NF4_DQ_STATE_BYTES,
    NF4_STATE_BYTES,
)
from lowmem_ft.memory.linears import lora_linears
from lowmem_ft.memory.records import DTYPE_BYTES, GB, Component, Device, Setup
from lowmem_ft.memory.savers import HOST_EMBEDDINGS

BATCH = "batch tensors (ids, labels, mask)"


def _tower_trainable(arch: Architecture, s: Setup) -> list[tuple[int, int]]:
    """A vision tower's trainable tensors under `vision.train` lora / full (`VisionTower.trainable`); none frozen."""
    if arch.vision is None or s.vision_train == "frozen":
        return []
    return arch.vision.trainable(s.vision_train, s.lora_r, DTYPE_BYTES[s.compute_dtype])


def _trainable_tensors(arch: Architecture, s: Setup) -> list[tuple[int, int]]:
    """(numel, bytes per element) of each trainable tensor."""
    if s.adapter == "full":
        c = DTYPE_BYTES[s.compute_dtype]
        out: list[tuple[int, int]] = _tower_trainable(arch, s)
        for lin in arch.linears:
            out += [(lin.in_features * lin.out_features, c)] * arch.num_layers
            if lin.bias:
                out += [(lin.out_features, c)] * arch.num_layers
        norm_size = arch.hidden_size * (2 if arch.norm == "layer" else 1)
        out += [(norm_size, c)] * (arch.num_layers * arch.norms_per_layer + 1)
        if arch.qk_norm:  # Cohere's are per head: (heads, head_dim) and (kv heads, head_dim)
            q, k = (arch.num_heads, arch.num_kv_heads) if arch.qk_norm_per_head else (1, 1)
            out += [(q * arch.head_dim, c), (k * arch.head_dim, c)] * arch.num_layers
        out += [(1, c)] * (arch.block_extra_params * arch.num_layers)  # Apertus's xIELU scalars
        out.append((arch.embedding_params, c))
        if arch.lm_head_params:
            out.append((arch.lm_head_params, c))
        if arch.moe:  # the expert stacks and the router are trained too (planning refuses this: not measured)
            e, i, h = arch.moe.experts, arch.moe.intermediate_size, arch.hidden_size
            out += [(e * 2 * i * h, c), (e * h * i, c), (e * h, c)] * arch.num_layers
            if arch.moe.extra_norm_params:  # OLMoE's q/k norms span all heads, not head_dim
                out += [(arch.moe.extra_norm_params, c)] * arch.num_layers
        return out
    # peft LoRA: A is r × in, B is out × r, fp32 (autocast_adapter_dtype=True in lowmem_ft.train.model)
    out = _tower_trainable(arch, s)
    for lin in lora_linears(arch, s):
        out += [(s.lora_r * lin.in_features, 4), (lin.out_features * s.lora_r, 4)] * arch.num_layers
        if s.use_dora:  # peft dora.py DoraLinearLayer.update_layer: one magnitude per output feature, fp32 (autocast)
            out += [(lin.out_features, 4)] * arch.num_layers
    return out


def weight_bytes(arch: Architecture, s: Setup) -> tuple[float, float, str]:
    """(quantized linears, 16-bit rest, description) of the base weights."""
    c = DTYPE_BYTES[s.compute_dtype]
    # bitsandbytes replaces every nn.Linear but the LM head: a loaded vision tower's too (`Architecture.tower_linears`;
    # checked on a tiny Gemma3ForConditionalGeneration: its SigLIP q/k/v/out_proj and fc1/fc2 load as Linear4bit)
    tower = arch.tower_linears
    n_lin = arch.num_layers * sum(lin.in_features * lin.out_features for lin in arch.linears)
    n_lin += sum(lin.in_features * lin.out_features for lin in tower)
    n_rest = arch.total_params - n_lin  # embeddings, lm_head (once if tied), norms, biases
    if s.quantization == "nf4":
        bits = NF4_DQ_BITS if s.double_quant else NF4_BITS
        modules = arch.num_layers * len(arch.linears) + len(tower)
        state = modules * (NF4_DQ_STATE_BYTES if s.double_quant else NF4_STATE_BYTES)
        return n_lin * bits / 8 + state, n_rest * c, f"NF4 {bits:.3f} bit/param (bitsandbytes quantize_4bit, block 64)"
    if s.quantization == "int8":
        rows = arch.num_layers * sum(lin.out_features for lin in arch.linears) + sum(lin.out_features for lin in tower)
        return n_lin + rows * INT8_ROW_SCALE_BYTES, n_rest * c, "int8 + fp32 row scales (bnb Linear8bitLt)"
    return n_lin * c, n_rest * c, f"{s.compute_dtype} ({c} B/param)"


def trainer_fp32_states(arch: Architecture, s: Setup) -> int:
    """Elements of the trainable tensor whose states a bitsandbytes 8-bit optimizer keeps in 32 bits: transformers'
    `Trainer.create_optimizer` registers every `nn.Embedding` weight with bitsandbytes' `GlobalOptimManager` as
    `optim_bits: 32` (trainer.py). Only a full fine-tune trains the embeddings. Found by the exact CPU measurement of
    real runs (`lowmem_ft.train.measure.exact`): the estimator harness built its optimizer without the override."""
    if s.adapter != "full" or "8bit" not in s.optimizer:
        return 0
    return arch.embedding_params


def _bnb_tensors(tensors: list[tuple[int, int]], optimizer: str, fp32_numel: int) -> list[tuple[int, int, bool, int]]:
    """(numel, bytes per element, 8-bit states?, count) of bitsandbytes' trainable tensors, one of `fp32_numel`
    elements kept in 32 bits (`trainer_fp32_states`); optimizer/optimizer.py `init_state`: 8-bit only from
    `min_8bit_size` elements."""
    out = []
    for (numel, elem), count in Counter(tensors).items():  # a model repeats a few shapes many times
        eight_bit = "8bit" in optimizer and numel >= BNB_MIN_8BIT_SIZE
        if eight_bit and numel == fp32_numel:
            out.append((numel, elem, False, 1))
            count -= 1
        if count:
            out.append((numel, elem, eight_bit, count))
    return out


def optimizer_state_bytes(
    tensors: list[tuple[int, int]], optimizer: str, device: Device, fp32_numel: int = 0
) -> tuple[float, float]:
    """(on device, paged = may leave the device) bytes of optimizer states for these trainable tensors;
    `fp32_numel`: the tensor whose bitsandbytes states stay 32-bit (`trainer_fp32_states`)."""
    on_device = paged = 0.0
    if optimizer in ("adamw_torch", "adafactor"):
        for (numel, elem), count in Counter(tensors).items():
            if optimizer == "adamw_torch":  # torch AdamW: exp_avg, exp_avg_sq zeros_like(param) → param dtype
                on_device += count * 2 * numel * elem
            else:  # factored row+col (approx. square), fp32
                on_device += count * (4 * numel**0.5 * 2 if numel > 1 else 4)
        return on_device, paged
    for numel, _, eight_bit, count in _bnb_tensors(tensors, optimizer, fp32_numel):
        blocks = -(-numel // BNB_BLOCK)
        size = count * (2 * numel + 2 * 4 * blocks if eight_bit else 2 * 4 * numel)
        if optimizer.startswith("paged") and device == "cuda" and numel >= BNB_PAGED_MIN:
            paged += size
        else:
            on_device += size
    return on_device, paged


def optimizer_step_temp(
    tensors: list[tuple[int, int]], optimizer: str, device: Device, fp32_numel: int = 0
) -> tuple[float, str]:
    """Temporaries the optimizer step allocates (measured on the CPU; read from torch/optim/adamw.py on CUDA)."""
    if not tensors:
        return 0.0, ""
    if optimizer == "adamw_torch":
        if device == "cuda":  # _multi_tensor_adamw: exp_avg_sq_sqrt = torch._foreach_sqrt(...) → one copy of all
            return sum(n * e for n, e in tensors), "torch AdamW foreach: one param-sized sqrt buffer"
        largest = max(n * e for n, e in tensors)
        return 2 * largest, "torch AdamW single-tensor (CPU): sqrt and divide temporaries of the largest tensor"
    if optimizer == "adafactor":
        return 2 * max(n * e for n, e in tensors), "Adafactor update temporaries of the largest tensor"
    # bitsandbytes: CUDA kernels update in place; the CPU fallback dequantizes a tensor's states to fp32.
    if device == "cuda":
        return 0.0, "bitsandbytes fused kernel, in place"
    # backends/cpu/ops.py, one tensor at a time. _optimizer_update_8bit_blockwise_cpu: fp32 state1, state2, grad
    # (g.float()), p.float(), and sqrt(state2) / correction2 → denom: 6 fp32 copies of the tensor at once;
    # _optimizer_update_32bit_cpu: grad, p.float(), the sqrt + eps denominator and the update: 4. An fp32 parameter
    # needs no p.float() copy: one fewer. Measured with PeakMemory seeing inside the kernels (they are Python,
    # lowmem_ft.train.measure.peak.python_cpu_kernels): 6 / 5 (8-bit, bf16 / fp32 parameter), 4 / 3 (32-bit).
    copies = max(
        numel * ((6 if eight_bit else 4) - (elem == 4))
        for numel, elem, eight_bit, _ in _bnb_tensors(tensors, optimizer, fp32_numel)
    )
    return 4 * copies, "bitsandbytes CPU kernel: 6 (8-bit states) or 4 (32-bit) fp32 copies of a tensor (measured)"


# The Setup fields only the step's own terms read: the batch's shape, and the savers and loss that reshape what the
# step keeps alive. The model states read none of them (tests/memory/test_static.py varies each, on every family).
_STEP_ONLY = {
    "micro_batch_size": 1, "max_seq_len": 1, "gradient_accumulation": 1, "loss_tokens": None,
    "gradient_checkpointing": False, "activation_offloading": False, "loss_impl": "trl_fused",
    "loss_chunk_tokens": None, "tiled_mlp": False, "mlp_tile_tokens": 0, "recompute_lora": False,
    "tiled_norms": False, "allocator": "expandable segments",
}  # fmt: skip


def states_key(s: Setup) -> Setup:
    """`s` with what only the step reads cleared (`_STEP_ONLY`): the key of what depends on the model and the method
    alone. The planner tries hundreds of batch shapes, lengths and savers of one setup."""
    return replace(s, **_STEP_ONLY)


class Trained(NamedTuple):
    """What the step's other terms read of the trainable tensors, counted once per setup (`_state`)."""

    numel: int  # trainable elements
    step_temp: float  # `optimizer_step_temp`'s bytes and source for this setup's optimizer and device
    step_source: str


def _static_components(arch: Architecture, s: Setup) -> tuple[list[Component], list[str], Trained]:
    """Weights, trainable parameters, their gradients and optimizer states (static), and what lives on the host;
    what the step's other terms read of the trainable tensors."""
    before, after, notes, trained = _state(arch, states_key(s))
    held = s.gradient_accumulation + (1 if s.device == "cpu" else 0)
    batch = Component(BATCH, BATCH_BYTES_PER_TOKEN * s.tokens * held, "static",
                      f"{held} micro batches × int64 ids, labels, mask (the accumulation window"
                      + (" + the loader's next one)" if s.device == "cpu" else ")"))  # fmt: skip
    return [*before, batch, *after], list(notes), trained


@lru_cache(maxsize=512)
def _state(
    arch: Architecture, s: Setup
) -> tuple[tuple[Component, ...], tuple[Component, ...], tuple[str, ...], Trained]:
    """`_static_components` less the batch tensors, for a setup cleared of what only the step reads (`_STEP_ONLY`):
    the planner estimates hundreds of batch shapes, lengths and savers of one setup, and this part depends on none.
    Returns the components before and after the batch's, the notes and what is read of the trainable tensors (a sum
    or a maximum over hundreds of tensors, once here rather than in every estimate)."""
    c = DTYPE_BYTES[s.compute_dtype]
    comps: list[Component] = []
    notes: list[str] = []
    w_lin, w_rest, w_desc = weight_bytes(arch, s)
    comps.append(Component("base weights (linears)", w_lin, "static", w_desc))
    rest_what = "embeddings + lm_head" if not arch.tie_embeddings else "tied embeddings (once)"
    if host := HOST_EMBEDDINGS.host_table(arch, s):  # the frozen table stays in host memory
        w_rest -= host.bytes
        rest_what = "lm_head"
        comps.append(host)
    if arch.moe:  # the expert stacks and routers are not nn.Linear: bitsandbytes leaves them in the compute dtype
        experts = c * arch.num_layers * (arch.moe.layer_params(arch.hidden_size) - arch.moe.extra_norm_params)
        w_rest -= experts
        comps.append(Component("experts + routers (16-bit)", experts, "static", MOE_WEIGHTS_SOURCE))
    comps.append(Component(f"16-bit {rest_what}, norms", w_rest, "static", "kept in compute dtype (not quantized)"))
    trainable = _trainable_tensors(arch, s)
    n_train = sum(n for n, _ in trainable)
    if s.adapter == "lora":  # a fully trained tower's parameters are its copy (`memory.tower.tower_copy_component`)
        copied = sum(n for n, _ in _tower_trainable(arch, s)) if s.vision_train == "full" else 0
        comps.append(Component("LoRA parameters (fp32)", 4 * (n_train - copied), "static",
                               "peft autocast_adapter_dtype=True"))  # fmt: skip
    grads = sum(n * e for n, e in trainable)
    comps.append(Component("gradients", grads, "static", "one per trainable parameter, in its dtype"))
    fp32_states = trainer_fp32_states(arch, s)
    states, paged = optimizer_state_bytes(trainable, s.optimizer, s.device, fp32_states)
    comps.append(Component(f"optimizer states ({s.optimizer})", states, "static", "bitsandbytes / torch init_state"))
    after: list[Component] = []
    if paged:
        after.append(Component("paged optimizer states", paged, "host", "bnb paged memory: evicted under pressure"))
        notes.append(f"{paged / GB:.2f} GB of optimizer state is paged (unified memory) and not counted in the peak")
    trained = Trained(n_train, *optimizer_step_temp(trainable, s.optimizer, s.device, fp32_states))
    return tuple(comps), tuple(after), tuple(notes), trained


MOE_WEIGHTS_SOURCE = "3-D expert parameters + router: bnb replaces nn.Linear only (integrations/bitsandbytes.py)"
