"""Per-device memory under data parallelism: what DDP, ZeRO-1/2/3 and FSDP leave on each GPU (no torch import).

The one idea: a training process holds a few kinds of model state — base weights, trainable weights, their
gradients, fp32 master copies and optimizer states — and each strategy either replicates a kind on every device or
divides it over N; full sharding (FSDP FULL_SHARD, ZeRO-3) then gathers one unit (a decoder layer) back at a time.
Activations are per device already (the micro batch is per device) and pass through unchanged. Offloading moves
states to host memory, where they still count, per process and per node.

Inputs are bytes for the whole model (`ModelStates`), so the same functions serve QLoRA (4-bit frozen base, fp32
LoRA) and DeepSpeed's own full fine-tune model. `tests/memory/test_sharding.py` reproduces the numbers of
DeepSpeed's `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`
(deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, deepspeedai/DeepSpeed master). `fsdp2_phase_bytes` is the
per-rank, per-phase form for torch's `fully_shard`, measured rank by rank on CPU ranks (benchmarks/fsdp_grid.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Literal, get_args

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import (
    BATCH,
    DTYPE_BYTES,
    Component,
    Estimate,
    Setup,
    _trainable_tensors,  # the estimate's own list of trainable tensors, so both count the same parameters
    backward_beside_layers,
    estimate,
    layer_moments,
    optimizer_state_bytes,
    optimizer_step_temp,
    trainer_fp32_states,
    weight_bytes,
)
from lowmem_ft.memory.static import states_key

Strategy = Literal["ddp", "zero1", "zero2", "zero3", "fsdp"]
STRATEGIES: tuple[Strategy, ...] = ("ddp", "zero1", "zero2", "zero3", "fsdp")

# torch FSDP BackwardPrefetch.BACKWARD_PRE (torch/distributed/fsdp/api.py, the default accelerate writes): "at the
# peak, it holds the current set of parameters, next set of parameters, and current set of gradients". DeepSpeed's
# ZeRO-3 estimator counts one layer's 16-bit parameters and gradients (4 × largest_layer_params).
FSDP_UNITS_GATHERED = 2
ZERO3_UNITS_GATHERED = 1
# DeepSpeed estimators: "additional_buffer_factor=1.5" on host memory (pinned buffers, fragmentation).
DS_HOST_BUFFER_FACTOR = 1.5


@dataclass(frozen=True)
class ModelStates:
    """What one process would hold for the whole model on a single device, split by kind (bytes).

    `trainable_params` counts the parameters that get gradients; the per-parameter byte sizes say how each kind is
    stored. Frozen weights (a QLoRA base: NF4 bytes + quantization constants + 16-bit embeddings and norms) get no
    gradients and no optimizer state.
    """

    frozen_weight_bytes: float = 0.0
    trainable_params: float = 0.0
    weight_bytes_per_param: float = 2.0  # trainable weights as stored: bf16 full fine-tune 2, fp32 LoRA 4
    grad_bytes_per_param: float = 2.0  # the gradient backward produces, in the weight's dtype
    grad_accum_bytes_per_param: float = 0.0  # DeepSpeed's fp32 gradient partition next to 16-bit weights: 4
    master_bytes_per_param: float = 0.0  # fp32 master weights of 16-bit trainable weights (mixed precision): 4
    optimizer_bytes_per_param: float = 8.0  # AdamW fp32 m and v: 8; bitsandbytes 8-bit: ~2
    largest_unit_params: float = 0.0  # parameters of the largest unit gathered at once (a decoder layer)
    largest_unit_bytes: float = 0.0  # its bytes as stored (NF4 layer: ~0.52 B/param); 0 → params × weight bytes
    largest_unit_trainable_params: float = 0.0  # of which trainable (their gradients are gathered too)
    # Never sharded: bitsandbytes keeps NF4 quantization constants in `Params4bit.quant_state`, not in a parameter,
    # so FSDP's flat parameters (and ZeRO's partitions) leave them whole on every device.
    replicated_bytes: float = 0.0
    # FSDP's root unit (embeddings, final norm, lm_head outside the wrapped layers) stays gathered from forward to
    # backward: torch/distributed/fsdp/_runtime_utils.py `_post_forward_reshard` "Do not free the root's parameters
    # in the post-forward for FULL_SHARD".
    resident_unit_bytes: float = 0.0
    resident_unit_trainable_params: float = 0.0
    # Of the root unit, the bytes accelerate's FSDP2 path gathers only around the input embedding (an untied
    # embedding is a unit of its own, resharded after forward: accelerate 1.16 utils/fsdp_utils.py
    # `fsdp2_prepare_model`, "Carve embed + tail=[final_norm, lm_head] into their own units"); 0 when tied (the
    # embedding joins the tail unit, gathered from the first forward to the end of the backward).
    separate_embedding_bytes: float = 0.0
    # Bytes per trainable parameter of a gathered unit's unsharded gradient (0: `grad_bytes_per_param`): FSDP2's
    # mixed precision computes them in its `param_dtype` while the sharded gradients keep the parameters' dtype.
    unit_grad_bytes_per_param: float = 0.0

    @property
    def unit_bytes(self) -> float:
        return self.largest_unit_bytes or self.largest_unit_params * self.weight_bytes_per_param

    @property
    def unit_grad_bytes(self) -> float:
        return self.unit_grad_bytes_per_param or self.grad_bytes_per_param


@dataclass(frozen=True)
class DeviceShare:
    """Bytes on one device (and on the host, per process) for a strategy; every field is per process."""

    strategy: Strategy
    gpus: int
    weights: float
    gradients: float
    optimizer: float  # optimizer states + fp32 master weights + fp32 gradient partition (what the step needs)
    gathered: float  # unsharded unit(s) in flight (full shard only)
    comm_buffers: float  # DDP gradient buckets
    activations: float
    host: float  # offloaded to host memory, per process
    offload_optimizer: bool = False
    offload_params: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def device_bytes(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.gathered + self.comm_buffers + self.activations

    def host_per_node(self, gpus_per_node: int, buffer_factor: float = 1.0) -> float:
        return self.host * gpus_per_node * buffer_factor


def per_device(
    states: ModelStates,
    strategy: Strategy,
    gpus: int,
    *,
    activations: float = 0.0,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> DeviceShare:
    """Bytes per device of `states` trained on `gpus` devices with `strategy`.

    - ddp: everything replicated, plus DDP's gradient buckets (torch DistributedDataParallel
      `gradient_as_bucket_view=False`, the default accelerate and transformers keep: "the saved memory size will be
      equal to the total gradients size" when it is True, so False costs one more copy of the gradients).
    - zero1: optimizer states (with fp32 master and gradient partition) ÷ N; weights and gradients replicated.
    - zero2: gradients ÷ N too.
    - zero3 / fsdp (full shard): weights ÷ N as well, plus the largest unit gathered back at once.
    - offload_optimizer (ZeRO only; FSDP offloads parameters and optimizer together, see `offload_params`): the
      optimizer part and the gradient partition live on the host; DeepSpeed's estimators keep only the 16-bit
      weights (and the gathered unit) on the GPU.
    - offload_params (ZeRO-3 / FSDP only): the weight shard lives on the host too.
    """
    _check(strategy, gpus, offload_optimizer, offload_params)
    weights, grads, step_state, gathered, comm, notes = _divided(states, strategy, float(gpus))
    replicated = states.replicated_bytes
    host = 0.0
    if offload_optimizer:
        host += step_state
        step_state = 0.0
        # ZeRO-Offload copies each reduced gradient partition into the host buffer (stage_1_and_2.py
        # `async_accumulate_grad_in_cpu_via_gpu` / stage3 offload): no 16-bit gradient partition stays on GPU.
        grads = 0.0
    if offload_params:
        host += weights
        weights = 0.0
    return DeviceShare(
        strategy=strategy,
        gpus=gpus,
        weights=weights + replicated,
        gradients=grads,
        optimizer=step_state,
        gathered=gathered,
        comm_buffers=comm,
        activations=activations,
        host=host,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        notes=tuple(notes),
    )


def _divided(states: ModelStates, strategy: Strategy, n: float) -> tuple[float, float, float, float, float, list[str]]:
    """(weights, gradients, optimizer step state, gathered unit, DDP buckets, notes) per device before any offload:
    what `strategy` divides by the `n` devices and what it adds."""
    p = states.trainable_params
    weights = states.frozen_weight_bytes + p * states.weight_bytes_per_param
    grads = p * states.grad_bytes_per_param
    step_state = p * (
        states.grad_accum_bytes_per_param + states.master_bytes_per_param + states.optimizer_bytes_per_param
    )
    notes: list[str] = []
    gathered = comm = 0.0
    if strategy == "ddp":
        comm = grads
    if strategy in ("zero1", "zero2", "zero3", "fsdp"):
        step_state /= n
    if strategy in ("zero2", "zero3", "fsdp"):
        grads /= n
    if strategy in ("zero3", "fsdp"):
        weights /= n
        gathered, notes = _gathered(states, strategy)
        if strategy == "zero3":
            # stage3.py: 4 × largest_layer_params = the layer's 16-bit parameters and gradients; and its 18 bytes
            # per parameter (2 params16 + 4 grads32 + 4 params32 + 8 Adam) carry no persistent 16-bit gradient
            # partition: gradients are reduce-scattered straight into the fp32 partition.
            grads = 0.0
    return weights, grads, step_state, gathered, comm, notes


def _check(strategy: str, gpus: int, offload_optimizer: bool, offload_params: bool) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    if gpus < 1:
        raise ValueError("gpus must be at least 1")
    if offload_params and strategy not in ("zero3", "fsdp"):
        raise ValueError(f"parameter offload needs a full-shard strategy (zero3, fsdp), not {strategy}")
    if offload_optimizer and strategy == "ddp":
        raise ValueError("optimizer offload needs ZeRO or FSDP; DDP keeps the optimizer on the device")


def _gathered(states: ModelStates, strategy: str) -> tuple[float, list[str]]:
    """What full sharding gathers back at once: the largest units (and their gradients), and FSDP's root unit."""
    units = ZERO3_UNITS_GATHERED if strategy == "zero3" else FSDP_UNITS_GATHERED
    gathered = units * states.unit_bytes + states.largest_unit_trainable_params * states.grad_bytes_per_param
    notes = []
    if strategy == "fsdp" and states.resident_unit_bytes:
        gathered += states.resident_unit_bytes + states.resident_unit_trainable_params * states.grad_bytes_per_param
        notes.append(f"root unit (embeddings, lm_head) of {states.resident_unit_bytes / 1e9:.3g} GB kept gathered")
    notes.append(f"{units} unit(s) of {states.unit_bytes / 1e9:.3g} GB gathered at once")
    return gathered, notes


def deepspeed_states(total_params: float, largest_layer_params: float = 0.0) -> ModelStates:
    """DeepSpeed's estimator model: fp16/bf16 weights and gradients, fp32 master, fp32 gradient partition, Adam.

    stage_1_and_2.py: "18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit".
    """
    return ModelStates(
        trainable_params=total_params,
        weight_bytes_per_param=2,
        grad_bytes_per_param=2,
        grad_accum_bytes_per_param=4,
        master_bytes_per_param=4,
        optimizer_bytes_per_param=8,
        largest_unit_params=largest_layer_params,
        largest_unit_trainable_params=largest_layer_params,
    )


# (strategy, offload_optimizer, offload_params) in the order `choose` tries them. FSDP's CPU offload moves
# parameters, gradients and the optimizer step to the host together (torch FSDP CPUOffload(offload_params=True)).
CANDIDATES: tuple[tuple[Strategy, bool, bool], ...] = (
    ("ddp", False, False),
    ("fsdp", False, False),
    ("fsdp", True, True),
)


def choose(
    states: ModelStates,
    gpus: int,
    budget_bytes: float,
    *,
    activations: float = 0.0,
    candidates: tuple[tuple[Strategy, bool, bool], ...] = CANDIDATES,
) -> tuple[DeviceShare, bool]:
    """The first candidate whose bytes per device fit `budget_bytes`.

    DDP first: when the model fits whole on each device, replication costs no communication beyond the gradient
    all-reduce. Returns (share, fits); when nothing fits, the candidate with the fewest device bytes and False.
    """
    shares = [
        per_device(states, s, gpus, activations=activations, offload_optimizer=oo, offload_params=op)
        for s, oo, op in candidates
    ]
    for share in shares:
        if share.device_bytes <= budget_bytes:
            return share, True
    return min(shares, key=lambda s: s.device_bytes), False


# -- from the single-device estimate ------------------------------------------------------------------------------
# Optimizers that can step on the host once their states are offloaded: bitsandbytes 8-bit and paged optimizers are
# CUDA kernels (bitsandbytes optim/optimizer.py dispatches to lib.cadam* / cpaged*), torch's run anywhere.
OFFLOAD_OPTIMIZERS = ("adamw_torch", "adafactor")


def states_of(arch: Architecture, s: Setup, fsdp2: bool = False, mixed: bool | None = None) -> ModelStates:
    """The model states of `estimate(arch, s)`, split by kind, with the unit FSDP / ZeRO-3 gathers at once: counted
    once per model, method and sharding (`_states_of`), whatever the batch and the savers."""
    return _states_of(arch, states_key(s), fsdp2, mixed)


@lru_cache(maxsize=512)
def _states_of(arch: Architecture, s: Setup, fsdp2: bool, mixed: bool | None) -> ModelStates:
    """`states_of` for a setup cleared of what only the step reads (`static.states_key`: none of this reads it).

    Same functions as the estimate, so the per-device figures add up to its static components when N = 1.
    NF4 linears: the packed 4-bit weight (0.5 B/param, stored in a float `bnb_4bit_quant_storage` dtype so FSDP can
    flatten it) is sharded; the rest of `weight_bytes` (absmax / double-quant constants) is replicated.
    `fsdp2`: as accelerate's FSDP2 path shards and casts them (its embedding unit; on a GPU its mixed precision,
    `fsdp2_mixed_precision`, or as `mixed` says: the CPU form of a GPU run's rank, `fsdp2_phase_bytes`).
    """
    c = DTYPE_BYTES[s.compute_dtype]
    mixed = fsdp2 and (fsdp2_mixed_precision(s) if mixed is None else mixed)
    w_lin, w_rest, _ = weight_bytes(arch, s)
    n_lin = arch.linear_params
    shardable_lin = n_lin / 2 if s.quantization == "nf4" else (n_lin if s.quantization == "int8" else w_lin)
    replicated = w_lin - shardable_lin
    trainable = _trainable_tensors(arch, s)
    if mixed and s.adapter == "full":  # accelerate upcasts 16-bit trainable weights to fp32 before sharding
        trainable = [(n, 4) for n, _ in trainable]
    n_train = float(sum(n for n, _ in trainable)) or 1.0
    train_bytes = sum(n * e for n, e in trainable)
    opt_on_device, _paged = optimizer_state_bytes(trainable, s.optimizer, s.device, trainer_fp32_states(arch, s))
    layer_norms = arch.num_layers * arch.norm_params * c
    root_bytes = w_rest - layer_norms  # embeddings, lm_head (once if tied), final norm
    embedding = 0.0 if arch.tie_embeddings or not fsdp2 else arch.embedding_params * c
    gathered_grad = c if mixed else 0.0  # FSDP2's param_dtype: the gathered unit and its gradients in 16 bits
    if s.adapter == "full":
        return ModelStates(
            trainable_params=n_train,
            weight_bytes_per_param=train_bytes / n_train,
            grad_bytes_per_param=train_bytes / n_train,
            optimizer_bytes_per_param=opt_on_device / n_train,
            largest_unit_params=arch.block_params,
            largest_unit_bytes=arch.block_params * c,
            largest_unit_trainable_params=arch.block_params,
            resident_unit_bytes=root_bytes,
            resident_unit_trainable_params=root_bytes / c,
            separate_embedding_bytes=embedding,
            unit_grad_bytes_per_param=gathered_grad,
        )
    lora_per_layer = n_train / arch.num_layers
    return ModelStates(
        frozen_weight_bytes=shardable_lin + w_rest,
        trainable_params=n_train,
        weight_bytes_per_param=4,  # fp32 LoRA (peft autocast_adapter_dtype)
        grad_bytes_per_param=train_bytes / n_train,
        optimizer_bytes_per_param=opt_on_device / n_train,
        largest_unit_params=arch.block_params + lora_per_layer,
        largest_unit_bytes=(shardable_lin + layer_norms) / arch.num_layers + (c if mixed else 4) * lora_per_layer,
        largest_unit_trainable_params=lora_per_layer,
        replicated_bytes=replicated,
        resident_unit_bytes=root_bytes,
        separate_embedding_bytes=embedding,
        unit_grad_bytes_per_param=gathered_grad,
    )


def fsdp2_mixed_precision(s: Setup) -> bool:
    """Whether FSDP2 runs under accelerate's mixed precision: a GPU run with 16-bit compute (the launch config's
    `mixed_precision`, `train.distributed.launch.mixed_precision`) on the FSDP2 path. accelerate then sets
    `MixedPrecisionPolicy(param_dtype, reduce_dtype)` to the 16-bit dtype (utils/dataclasses.py
    `set_mixed_precision`) and, before sharding, upcasts every 16-bit trainable weight to fp32
    (utils/fsdp_utils.py `fsdp2_prepare_model`: "Upcast to fp32 master weights"): a full fine-tune's shards,
    their gradients and the optimizer states (torch AdamW: `zeros_like(param)`) are fp32, what a unit gathers is
    16-bit. Traced: Llama-3.1-8B full on 4 ranks, 32.12 GB of static state per rank where 16-bit shards would
    hold 16.06 (docs/several-gpus.md)."""
    return s.device != "cpu" and s.compute_dtype in ("bfloat16", "float16") and fsdp_version(s.quantization)[0] == 2


def lora_in_compute_dtype(s: Setup, strategy: str, mixed: bool | None = None) -> bool:
    """Whether the plan runs LoRA's weights in the compute dtype (`Setup.lora_in_compute_dtype`, whose activation
    terms are `memory.linears`'): FSDP under a GPU run's 16-bit mixed precision (`mixed`: as `states_of`'s; default
    on a GPU). FSDP2: accelerate's `MixedPrecisionPolicy(param_dtype)` gathers every parameter, LoRA's included, in
    that dtype (the fp32 upcast of `fsdp2_mixed_precision` keeps only the shards fp32; traced:
    benchmarks/fsdp_verify.md). FSDP1 (4-bit weights): transformers' `update_fsdp_plugin_peft` sets the mixed
    precision to the 4-bit storage dtype, the compute dtype (train/model.py), and FSDP1 gathers the flat parameter,
    LoRA's weights within it, in its `param_dtype` (read from code, not traced: `fsdp_version`)."""
    if strategy != "fsdp" or s.adapter != "lora" or s.compute_dtype not in ("bfloat16", "float16"):
        return False
    return s.device != "cpu" if mixed is None else mixed


def device_estimate(arch: Architecture, est: Estimate, share: DeviceShare) -> Estimate:
    """`est` (one device holding everything) with its static state replaced by `share`: the peak per device.

    Transient terms (activations, loss, dequantization buffer, optimizer temporaries) are per device already: the
    micro batch is per device. An offloaded optimizer steps on the host, so its temporaries are kept here as an
    upper bound (small for adapters). FSDP2 (`fully_shard`, `fsdp_version`) is planned phase by phase
    (`fsdp2_phases`): what it gathers is a transient of the forward and the backward, and its optimizer steps on
    the shards. FSDP1 (kept for 4-bit weights) and ZeRO-3 keep an allowance for the gathered units in every phase
    (`_gathered`: FSDP1's BACKWARD_PRE prefetch, DeepSpeed's estimator).
    """
    static = sum(c.bytes for c in est.components if c.phase == "static")
    what = {"ddp": "replicated", "zero1": "replicated", "zero2": "replicated"}.get(share.strategy, "1/N shard")
    n = share.gpus
    phases: dict[str, float] = {}
    gathered = Component("gathered units (all-gather)", share.gathered, "static", "; ".join(share.notes))
    if share.strategy == "fsdp" and fsdp_version(est.setup.quantization)[0] == 2:
        phases, held = fsdp2_phases(arch, est, states_of(arch, est.setup, fsdp2=True), share)
        at = max(("forward", "backward"), key=lambda ph: phases[ph])
        gathered = Component("gathered units (all-gather)", held[at], "forward/backward", str(held["source"]))
    per = [
        Component(f"weights ({what}{' → host' if share.offload_params else ''})", share.weights, "static",
                  f"{share.strategy} on {n} devices (lowmem_ft.memory.sharding)"),
        Component("gradients", share.gradients, "static", f"{share.strategy}: " + (
            "replicated" if share.strategy in ("ddp", "zero1") else "reduce-scattered, 1/N")),
        Component("optimizer states", share.optimizer, "static",
                  "replicated" if share.strategy == "ddp" else "1/N shard (ZeRO / FSDP)"),
        gathered,
        Component("DDP gradient buckets", share.comm_buffers, "static", "gradient_as_bucket_view=False"),
    ]  # fmt: skip
    per += [c for c in est.components if c.name == BATCH]  # each device holds its own micro batches
    if share.host:
        per.append(Component("offloaded to host (per process)", share.host, "host", "CPU offload"))
    rest = [c for c in est.components if c.phase != "static"]
    notes = [*est.notes, f"per device: {share.strategy} over {n} devices"]
    if phases:
        rest = [
            replace(c, bytes=c.bytes / n, source=f"{c.source}; on the 1/N shards (FSDP2)")
            if c.phase == "optimizer step" else c
            for c in rest
        ]  # fmt: skip
        step = ("forward", "backward", "optimizer step")
        peak = max(phases[ph] for ph in step)
        at = "optimizer step" if phases["optimizer step"] > max(phases["forward"], phases["backward"]) else (
            "forward/backward")  # fmt: skip
        return Estimate(per + rest, est.setup, peak, est.overhead_bytes, at, notes, phases,
                        allocator_block=est.allocator_block)  # fmt: skip
    device_static = sum(c.bytes for c in per if c.phase == "static")
    # the steady state (every static component alive): one micro batch per step frees the single device's
    # gradients before its forward (`Estimate.first_micro_batch`), not a sharded or bucketed share of them
    return Estimate(per + rest, est.setup, est.steady_peak_bytes - static + device_static, est.overhead_bytes,
                    est.peak_phase, notes, allocator_block=est.allocator_block)  # fmt: skip


# -- the strategies the planner tries (several devices) -------------------------------------------------------------
# Strategies the planner tries in order for `--gpus N` (strategy, offload): replication first (only the gradient
# all-reduce), then full sharding (an all-gather per layer), then host offload (PCIe copies every step) — each step
# saves device memory at a cost in speed. A user-given --strategy keeps its strategy; offload stays a further step.
Requested = Literal["auto", "ddp", "fsdp", "zero2", "zero3"]
STAGES: dict[str, tuple[tuple[str, bool], ...]] = {
    "auto": (("ddp", False), ("fsdp", False), ("fsdp", True)),
    "ddp": (("ddp", False),),
    "fsdp": (("fsdp", False), ("fsdp", True)),
    "zero2": (("zero2", False), ("zero2", True)),
    "zero3": (("zero3", False), ("zero3", True)),
}
assert tuple(STAGES) == get_args(Requested)


def per_device_estimate(
    arch: Architecture, s: Setup, gpus: int, strategy: str, offload: bool
) -> tuple[Estimate, DeviceShare | None]:
    """The estimate of one device: the single-device estimate when gpus == 1, else the strategy's share (its
    activations with LoRA's weights as the strategy runs them: `lora_in_compute_dtype`)."""
    if gpus == 1:
        return estimate(arch, s), None
    est = estimate(arch, replace(s, lora_in_compute_dtype=lora_in_compute_dtype(s, strategy)))
    full_shard = strategy in ("zero3", "fsdp")
    share = per_device(
        states_of(arch, s, fsdp2=strategy == "fsdp"),
        strategy,  # type: ignore[arg-type]
        gpus,
        offload_optimizer=offload,
        offload_params=offload and strategy == "fsdp" and full_shard,  # FSDP CPUOffload moves both together
    )
    return device_estimate(arch, est, share), share


def _stages(strategy: str, offload: bool | None, optimizer: str | None, quantization: str | None) -> list:
    """Strategy stages to try; offload only where the optimizer can step on the host, sharding not for int8."""
    if strategy not in STAGES:
        raise UserError(f"--strategy {strategy}: choose one of {', '.join(STAGES)}")
    if strategy == "ddp" and offload:
        raise UserError("--offload needs a sharded strategy (DDP keeps everything on the device); use --strategy fsdp")
    stages = [
        (st, off)
        for st, off in STAGES[strategy]
        if (offload is None or off == offload)
        and not (off and optimizer is not None and optimizer not in OFFLOAD_OPTIMIZERS)
        and not (st != "ddp" and quantization == "int8")  # bnb int8 weights have no float storage to shard
    ]
    if not stages:
        raise UserError(
            f"--strategy {strategy}{' --offload' if offload else ''}: no runnable combination "
            f"(offload needs optimizer.name adamw_torch or adafactor; int8 weights cannot be sharded)"
        )
    return stages


def fsdp_version(quantization: str | None) -> tuple[int, str]:
    """The FSDP the launch config asks accelerate for (`fsdp_version`), and why: the plan's reason line and
    `train.distributed.launch.accelerate_config` call this one function.

    FSDP2 (`fully_shard`, per-parameter DTensor shards: frozen and trainable weights share a unit, so LoRA needs no
    wrap policy of its own) except for 4-bit weights: transformers 5.24's Trainer sets the NF4 storage dtype as
    FSDP's mixed-precision dtype (`distributed/fsdp.py` `update_fsdp_plugin_peft`) only on the FSDP1 path
    (`trainer.py` `_prepare_for_training`: FSDP2 does not delay the optimizer, and that branch is where it is
    called), so under FSDP2 accelerate's bf16/fp16 policy would cast the packed 4-bit storage."""
    if quantization == "nf4":
        return 1, (
            "FSDP1 kept for 4-bit weights: transformers' Trainer sets their storage dtype for FSDP only on "
            "the FSDP1 path (update_fsdp_plugin_peft)"
        )
    return 2, "FSDP2 (fully_shard, per-parameter shards)"


def _strategy_reason(
    strat: str, off: bool, asked: str, gpus: int, tried: list, budget: float, quantization: str | None = None
) -> str:
    """Why this strategy: the per-device need of each stage tried before it (and, for FSDP, which version)."""
    verb = {"ddp": "DDP (a full copy per device)", "fsdp": "FSDP full shard", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
    name = verb[strat] + (" + CPU offload" if off else "")
    before = [f"{verb[t[0]] + (' + offload' if t[1] else '')} needs {t[2].peak_gb:.1f} GB" for t in tried[:-1]]
    last = tried[-1][2].peak_gb
    fits = last <= budget
    why = f"{name} on {gpus} devices: {last:.1f} GB per device " + (
        f"fits the {budget:.1f} GB budget" if fits else f"OVER the {budget:.1f} GB budget"
    )
    if before:
        why += f" ({'; '.join(before)} per device, over the budget)"
    elif strat == "ddp" and fits:
        why += " — the model fits whole on each device, so only gradients are all-reduced"
    if strat == "fsdp":
        why += f"; {fsdp_version(quantization)[1]}"
    return why + ("; strategy as asked (--strategy)" if asked != "auto" else "")


# -- FSDP2 per rank, phase by phase (CPU form) ----------------------------------------------------------------------
# What torch's `fully_shard` (torch 2.13, torch/distributed/fsdp/_fully_shard/) holds beside a rank's shards, one
# decoder layer per unit and the rest (embeddings, final norm, lm_head) in the root unit, eager, one stream:
# - the root unit is gathered from the first forward to the end of the backward (_fsdp_state.py `_lazy_init`: "For
#   the root, do not reshard after forward"), and its gradients (a full fine-tune's embeddings / lm_head) stay
#   unsharded until its post-backward reduce-scatter;
# - forward: a layer's flat all-gather buffer (N × its padded shard = the unit's bytes) is kept until the next unit's
#   copy-out, and the last layer's until the root's post-forward (`wait_for_unshard` → `AllGatherState`,
#   `_post_forward` "Free the last all-gather result"): at the head, root + 1 unit; inside layer k, its gathered
#   parameters + layer k−1's buffer, 2 units;
# - backward: each unit's pre-backward gathers the unit that runs next (`_backward_prefetch`; the root's prefetches
#   the last layer): at the head, root + 1 unit (the root's gradients not yet written); inside layer k, layer k and layer k−1 gathered, layer k's
#   unsharded gradients, and layer k+1's reduce-scatter input (N × padded gradient shard, kept until the next
#   reduce-scatter: `ReduceScatterState`);
# - the optimizer steps on the shards only: its temporaries are 1/N of a single device's.
# Measured exactly, per rank, in `benchmarks/fsdp_grid.md` (`python -m devkit.bench.fsdp_grid`).
FSDP2_HEAD_UNITS = {"forward": 1, "backward": 1}
FSDP2_LAYER_UNITS = {"forward": 2, "backward": 2}
FSDP2_LAYER_RS_BUFFERS = 1  # the previous layer's reduce-scatter input, in backward


def fsdp2_phase_bytes(
    arch: Architecture, s: Setup, gpus: int, mixed: bool = False, offload: bool = False
) -> dict[str, float]:
    """Each rank's live tensor bytes at the peak of each phase under FSDP2 on `gpus` ranks (CPU form, like
    `estimate.phase_peak_bytes`): "static", "forward", "backward", "optimizer step". `mixed`: under a GPU run's
    mixed precision (`fsdp2_mixed_precision`), as `plan --verify --gpus N` traces it: the gathered units in 16
    bits and LoRA's activation terms in the compute dtype (`lora_in_compute_dtype`); `offload`: the device's part
    under CPU offload (parameters, gradients and optimizer states on the host)."""
    states = states_of(arch, s, fsdp2=True, mixed=mixed)
    share = per_device(states, "fsdp", gpus, offload_optimizer=offload, offload_params=offload)
    s = replace(s, lora_in_compute_dtype=lora_in_compute_dtype(s, "fsdp", mixed))
    return fsdp2_phases(arch, estimate(arch, s), states, share)[0]


def fsdp2_phases(
    arch: Architecture, est: Estimate, states: ModelStates, share: DeviceShare
) -> tuple[dict[str, float], dict[str, float | str]]:
    """(phase → live bytes at its peak on one rank, phase → what FSDP2 holds gathered there, and its "source").

    The single device's phases (`est`, any device: live tensor bytes, no device overheads) with the static states
    replaced by the rank's (`share`, offloaded parts on the host), plus what FSDP2 gathers at the phase's two
    candidate moments (the LM head's and a decoder layer's, `estimate.layer_moments`). Between micro-steps nothing
    is gathered (every unit reshards after its backward)."""
    whole = per_device(states_of(arch, est.setup), "fsdp", 1)  # the states `est` holds: as loaded, not upcast
    shards = share.weights + share.gradients + share.optimizer - (whole.weights + whole.gradients + whole.optimizer)
    root_fwd = states.resident_unit_bytes
    root_grads = states.resident_unit_trainable_params * states.unit_grad_bytes
    unit = states.unit_bytes
    unit_grads = states.largest_unit_trainable_params * states.unit_grad_bytes
    # accelerate's units: an untied embedding is gathered only around its own forward and backward, the tail (final
    # norm, LM head) from the head's forward to the end of its backward; tied, the tail holds the embedding too and
    # stays gathered from the first forward to the end of the backward (the layers' moments see it)
    head_root = root_fwd - states.separate_embedding_bytes
    layer_root = 0.0 if states.separate_embedding_bytes else root_fwd
    static = est.phases["static"]
    layer = dict(zip(("forward", "backward"), layer_moments(arch, est), strict=True))
    out = {"static": static + shards}
    held: dict[str, float | str] = {}
    for phase in ("forward", "backward"):
        # at the head the root and one unit (forward: the last layer's buffer; backward: the last layer
        # prefetched, the root's gradients not yet written — measured: the full fine-tunes of
        # benchmarks/fsdp_grid.md land 3.6-7 % high with them there, within 0.1 % without)
        head_held = head_root + FSDP2_HEAD_UNITS[phase] * unit
        if phase == "forward" and states.separate_embedding_bytes and states.resident_unit_trainable_params:
            # untied and trained (a full fine-tune), the tail is the forward's last unit gathered: its own
            # all-gather buffer, not a layer's, is the one kept to the root's post-forward (measured: qwen2.5 full,
            # benchmarks/fsdp_grid.md, 3.4-3.9 % low with a layer's there, within 0.1 % with the tail's). A frozen
            # tail (LoRA) measures with a layer's (3.2-7.1 % high with the tail's).
            head_held = 2 * head_root
        layer_held = FSDP2_LAYER_UNITS[phase] * unit + layer_root
        if phase == "backward":  # the root's gradients (tied), this layer's and the last reduce-scatter's input
            layer_held += (root_grads if layer_root else 0.0) + (1 + FSDP2_LAYER_RS_BUFFERS) * unit_grads
        # the one device's head moment: its forward peak (the layers' beside it are the layer moment's own), its
        # backward peak less the layers' (measured: with a layer's there, Llama-3.1-70B QLoRA at 4 × 2,048 tokens on
        # 2 ranks, where a recomputed layer is the one device's backward peak, landed 3.5 % high: the layer's
        # moment with the head's unit held; benchmarks/fsdp_verify.md)
        head_moment = (est.phases[phase] if phase == "forward" else backward_beside_layers(arch, est)) + shards
        head_moment += head_held
        layer_moment = layer[phase] + shards + layer_held
        out[phase] = max(head_moment, layer_moment)
        held[phase] = head_held if head_moment >= layer_moment else layer_held
    step_temporaries = est.phases["optimizer step"] - static
    s = est.setup
    if s.adapter == "full" and states.weight_bytes_per_param != DTYPE_BYTES[s.compute_dtype]:
        # the optimizer steps fp32 shards (`fsdp2_mixed_precision`): its temporaries are those of fp32 tensors
        tensors = _trainable_tensors(arch, s)
        fp32 = trainer_fp32_states(arch, s)
        step_temporaries += (
            optimizer_step_temp([(n, 4) for n, _ in tensors], s.optimizer, s.device, fp32)[0]
            - optimizer_step_temp(tensors, s.optimizer, s.device, fp32)[0]
        )
    out["optimizer step"] = out["static"] + step_temporaries / share.gpus
    held["source"] = (
        f"FSDP2 per phase (torch _fully_shard): root unit {root_fwd / 1e9:.3g} GB gathered forward to backward, "
        f"{FSDP2_LAYER_UNITS['forward']} layer units of {unit / 1e9:.3g} GB in flight (sharding.fsdp2_phases)"
    )
    return out, held
