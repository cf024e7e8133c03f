"""Rank 0 of an N-rank FSDP2 step at full size, traced in one process: what one device of `--gpus N` holds.

The model is built as `lowmem_ft.train.trace.step` builds it (transformers' `from_pretrained` on shape-only
tensors, then `train`'s preparation, adapters and savers), then sharded by accelerate's own
`fsdp2_prepare_model` — the function a GPU run's `Accelerator.prepare` calls — with the FSDP2 plugin the written
accelerate config gives (`lowmem_ft.train.distributed.launch.fsdp_config`: one `fully_shard` per decoder layer,
the input embedding and the final norm + LM head as units of their own, the root; each layer resharded after its
forward) and the mixed precision of the GPU run (`launch.mixed_precision`: bf16 compute → FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`, and accelerate upcasts bf16 trainable weights to fp32
before sharding). The step is then `step.run_step` under `PeakMemory` with in-place storage resizes counted (FSDP2
gathers a unit by growing its parameters' storages).

The one idea: the other N − 1 ranks need not exist. torch's fake process group (backend "fake",
`torch.testing._internal.distributed.fake_pg`) answers every collective without communicating, and FSDP2 allocates
every buffer of its collectives itself (`_fsdp_collectives.py`: the all-gather output, N × the padded shard, and
the reduce-scatter input of N × the gradient shard and its output shard), so rank 0's bytes are those of an NCCL
run, which gathers and reduce-scatters into those buffers in place. gloo's extra clone of a reduce-scatter input
(`devkit/harness/fsdp.py`) does not occur: no process group copies anything here.

Checked on the zoo against the real thing: with the devkit harness's sharding (`devkit.harness.fsdp.shard`) and its
mixed precision (none, as on CPU ranks), rank 0's trace equals the harness's real gloo rank 0 to the byte, LoRA,
QLoRA and full fine-tuning on 2 ranks (`tests/train/trace/test_sharded.py`).

What is not traced: FSDP1, which the plan keeps for 4-bit weights (`memory.sharding.fsdp_version`). A 4-bit model
is traced under FSDP2 here, as accelerate's FSDP2 path would shard it (the packed weight in its float storage dtype
sharded like any tensor, the quantization constants whole on every rank); its figure is compared with the FSDP2
prediction, not with the FSDP1 plan's every-phase allowance, and `--verify` says so. Offloaded plans (FSDP's CPU
offload) are not traced: on the CPU, host and device are one memory.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import Recipe
from lowmem_ft.train.trace.step import Trace

MESH_DIM = "dp_shard"  # accelerate's name for the FSDP mesh dimension (ParallelismConfig.fsdp_dim_names)
# FSDP2 gathers and frees a unit by resizing its parameters' storages in place; here they are fake tensors' storages,
# which live on the meta device (`PeakMemory.fake_storages`)
PEAK_OPTIONS = {"storage_resizes": True, "fake_storages": True}


@contextmanager
def fake_group(world: int):
    """A default process group of `world` ranks in which this process is rank 0 and no collective communicates,
    and its one-dimensional CPU device mesh; the group is destroyed on exit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise UserError("--verify --gpus N traces in one process: a torch.distributed group is already running here")
    # the trainer's arguments, built inside the group, warn that it is not a DDP launch (training_args.py
    # `_setup_devices`): true of a one-process trace, and noise in `plan --verify`'s output
    args_log = logging.getLogger("transformers.training_args")
    level = args_log.level
    args_log.setLevel(logging.ERROR)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with collectives_keep_their_output():
            yield init_device_mesh("cpu", (world,), mesh_dim_names=(MESH_DIM,))
    finally:
        dist.destroy_process_group()
        args_log.setLevel(level)


@contextmanager
def collectives_keep_their_output():
    """torch's functional collectives hand back the tensor they wrote, as a run does, not a fake kernel's copy.

    A functional collective (the all-gather of `DTensor.full_tensor()`) ends in `_maybe_wrap_tensor`: eager, it wraps
    its output in an `AsyncCollectiveTensor` over the same storage (`_wrap_tensor_autograd`), or `wait_tensor`
    returns it; their fake kernels return `torch.empty_like` (`_functional_collectives.py` `_wait_tensor_meta` and
    `_wrap_tensor_autograd`'s `register_fake`), a second storage no run makes. TRL's fused head gathers an FSDP2-
    sharded LM head that way (trl/trainer/utils.py `_fused_forward`: `weight.full_tensor()`, the tail unit being
    ungathered while the head's own forward never runs), so the trace counted the head twice at the forward's
    head moment: 2.10 GB too many on Llama-3.1-70B, rank 0 of 4 (the batch-1 plan's forward, 18.64 traced against
    17.54 predicted, then 17.54 both; benchmarks/fsdp_verify.md). Checked eager on 2 gloo ranks: `full_tensor()`
    of a 64 MiB weight holds one 64 MiB copy at its peak. Here the collective's output is handed back itself, after
    a `wait_tensor` outside the trace's modes (it unregisters the collective's work, which torch otherwise warns of
    at exit; its fake result is dropped uncounted)."""
    from torch.distributed import _functional_collectives as funcol
    from torch.utils._python_dispatch import _disable_current_modes

    original = funcol._maybe_wrap_tensor

    def waited(tensor):
        with _disable_current_modes():  # the wait a run makes, its fake result not counted: only `tensor` lives on
            funcol.wait_tensor(tensor)
        return tensor

    funcol._maybe_wrap_tensor = waited
    try:
        yield
    finally:
        funcol._maybe_wrap_tensor = original


def mixed_precision(recipe: Recipe) -> str:
    """The mixed precision of the GPU run's accelerate config (`launch.mixed_precision`, not on CPU processes)."""
    from lowmem_ft.train.distributed.launch import LaunchPlan
    from lowmem_ft.train.distributed.launch import mixed_precision as launched

    return launched(recipe, LaunchPlan(gpus=2, strategy="fsdp", cpu=False))


def shard_as_accelerate(model, mesh, recipe: Recipe, precision: str, layer_cls: str | None = None) -> None:
    """`model` sharded in place by accelerate's `fsdp2_prepare_model` with the plugin our FSDP2 config gives, the
    units of class `layer_cls` (default: the model's `layer_class`). `cpu_ram_efficient_loading` is left off: with
    it rank 0 reads the weights and broadcasts them, which ends in the same shards; a trace has none to read."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    from lowmem_ft.train.distributed.launch import LaunchPlan, fsdp_config

    layer_cls = layer_cls or layer_class(type(model.get_base_model() if hasattr(model, "get_base_model") else model))
    config = fsdp_config(recipe, LaunchPlan(gpus=mesh.size(), strategy="fsdp"), layer_cls)
    saved = dict(os.environ)  # the plugin writes FSDP_* variables into the environment
    try:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            # a 4-bit model's config is FSDP1's (FULL_SHARD): under FSDP2 that is resharding after forward
            reshard_after_forward=config.get("fsdp_reshard_after_forward", True),
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=config["fsdp_transformer_layer_cls_to_wrap"].split(","),
            cpu_ram_efficient_loading=False,
            activation_checkpointing=config["fsdp_activation_checkpointing"],
        )
        if precision != "no":  # accelerate's AcceleratorState does this for an FSDP run
            plugin.set_mixed_precision(precision)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=mesh,
        parallelism_config=SimpleNamespace(fsdp_dim_names=(MESH_DIM,)),
        mixed_precision=precision,
        is_main_process=True,
        device=torch.device("cpu"),
    )
    from accelerate.utils import fsdp_utils

    adapter = fsdp_utils.logger  # accelerate's logger asks for an `Accelerator` state that a trace does not make
    fsdp_utils.logger = logging.getLogger(fsdp_utils.__name__)
    # its `model.state_dict()` feeds only the weight loading of `cpu_ram_efficient_loading` (off here), and a 4-bit
    # layer's state dict reads its quantization constants' values (`QuantState.as_dict`), which fake tensors lack
    model.state_dict = dict
    try:
        fsdp2_prepare_model(accelerator, model)
    finally:
        fsdp_utils.logger = adapter
        del model.state_dict


@contextmanager
def quant_state_on_gathered_weights(recipe: Recipe):
    """bitsandbytes' own repair of a gathered 4-bit weight, without the parameter class a fake tensor cannot take.

    A unit's gathered weight comes back from FSDP as a plain parameter without its `quant_state`; `Linear4bit`'s
    forward calls `fix_4bit_weight_quant_state_from_module`, which wraps it in a `Params4bit` sharing its storage
    (no new bytes) and puts the module's `quant_state` on it. `Params4bit` cannot wrap a fake tensor
    (`Tensor._make_subclass`, see `step`), so here the state is put on the parameter itself — the attribute the
    layer reads next, over the same storage."""
    if recipe.model.quantization != "nf4":
        yield
        return
    from bitsandbytes.nn import modules

    original = modules.fix_4bit_weight_quant_state_from_module

    def fix(module) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            module.weight.quant_state = module.quant_state

    modules.fix_4bit_weight_quant_state_from_module = fix
    try:
        yield
    finally:
        modules.fix_4bit_weight_quant_state_from_module = original


def step_on_local_shards(optimizer) -> None:
    """A bitsandbytes optimizer made to step on each DTensor parameter's local shard (and its gradient's).

    bitsandbytes' optimizer operators take no DTensor ("got mixed torch.Tensor and DTensor": its quantization maps
    and block scales are plain tensors), so under FSDP2 its step fails on the sharded parameters. The local shard is
    the same storage (no new bytes), and the states it creates are the shard's — what FSDP1, which the plan keeps for
    4-bit weights, hands the optimizer (its flat parameter's plain shard). Before each step the shards' gradients
    are the DTensor gradients' local tensors; `zero_grad` lets go of both."""
    from torch.distributed.tensor import DTensor

    # transformers' 32-bit override of the embeddings (`Trainer.create_optimizer`) names the DTensor parameter; its
    # place in the groups is what the optimizer looks up (`Optimizer8bit.check_overrides` → `index2config`)
    manager = optimizer.mng
    overrides = {id(getattr(module, attr)): config for module, attr, config in manager.module_weight_config_triple}
    pairs = []
    for gindex, group in enumerate(optimizer.param_groups):
        local = []
        for pindex, p in enumerate(group["params"]):
            if id(p) in overrides:
                manager.index2config[(gindex, pindex)] = overrides[id(p)]
            if isinstance(p, DTensor):
                pairs.append((p, p._local_tensor))
                local.append(p._local_tensor)
            else:
                local.append(p)
        group["params"] = local

    def grads_to_shards(*_) -> None:
        for p, shard in pairs:
            shard.grad = None if p.grad is None else p.grad._local_tensor

    zero_grad = optimizer.zero_grad

    def zero_both(set_to_none: bool = True) -> None:
        zero_grad(set_to_none=set_to_none)
        for p, _ in pairs:
            p.grad = None

    optimizer.register_step_pre_hook(grads_to_shards)
    optimizer.zero_grad = zero_both


def layer_class(cls) -> str:
    """The decoder layer class(es) FSDP shards by, as the launch config names them (`launch.layer_class`: the
    model class's `_no_split_modules`), read from the class alone (no Hub)."""
    names = ",".join(getattr(cls, "_no_split_modules", None) or [])
    if not names:
        raise UserError(f"cannot trace {cls.__name__} under FSDP: it names no layer class (_no_split_modules) to "
                        "shard by")  # fmt: skip
    return names


def check(recipe: Recipe, gpus: int, strategy: str) -> None:
    """A UserError unless one rank of this plan can be traced."""
    if strategy != "fsdp":
        raise UserError(
            f"--verify --gpus {gpus} traces FSDP plans only (--strategy fsdp); the plan is {strategy}: plan "
            "without --verify, or with --strategy fsdp"
        )
    if gpus < 2:
        raise UserError("--verify --gpus N: N must be at least 2 for a sharded trace")


def trace_rank(
    recipe: Recipe,
    gpus: int,
    config=None,
    *,
    whole: bool = False,
    warmup_seq: int = 8,
    precision: str | None = None,
    shard=None,
    offload: bool = False,
) -> Trace:
    """Trace rank 0 of `recipe`'s FSDP2 step on `gpus` ranks at its full batch, without weights.

    `precision`: accelerate's mixed precision (default: the GPU run's, `mixed_precision`). `shard(model, mesh)`:
    how the model is sharded (default: accelerate's `fsdp2_prepare_model`, `shard_as_accelerate`). Unless
    `whole`, a deep model is traced at two smaller depths and extrapolated, as `step.trace` does. `offload`: the
    plan's FSDP CPU offload — traced without it, then the bytes it keeps in host memory (`_host_shard_bytes`) are
    taken out of every figure (on the CPU, host and device are one memory)."""
    from lowmem_ft.train import methods
    from lowmem_ft.train.model import torch_dtype
    from lowmem_ft.train.trace import layers as trace_layers
    from lowmem_ft.train.trace.step import _model_class, model_config

    if recipe.model.trust_remote_code:
        raise UserError("cannot trace a model that runs its own code (--trust-remote-code)")
    if not methods.get(recipe.training.method).traced:
        raise UserError(f"--verify traces supervised fine-tuning steps; training.method={recipe.training.method} is "
                        "not traced yet (plan without --verify)")  # fmt: skip
    started = time.perf_counter()
    config = config if config is not None else model_config(recipe)
    precision = mixed_precision(recipe) if precision is None else precision
    cls = _model_class(config)
    if shard is None:
        layer_cls = layer_class(cls)

        def shard(model, mesh):
            shard_as_accelerate(model, mesh, recipe, precision, layer_cls)

    depth = None if whole else trace_layers.plan(cls, config, torch_dtype(recipe.model.compute_dtype))
    with fake_group(gpus) as mesh:
        if depth is None:
            segments = _traced(recipe, config, mesh, shard, warmup_seq, offload)
            return Trace(segments.marks(), time.perf_counter() - started)
        small = _traced(recipe, trace_layers.truncated(config, depth.first), mesh, shard, warmup_seq, offload)
        large = _traced(
            recipe, trace_layers.truncated(config, depth.first + depth.period), mesh, shard, warmup_seq, offload
        )
    return Trace(depth.extrapolate_marks(small, large), time.perf_counter() - started, 0, depth)


def _traced(recipe: Recipe, config, mesh, shard, warmup_seq: int, offload: bool = False):
    """One trace of rank 0 of the model `config` describes, sharded by `shard`: `trace_layers.Segments` (less what
    CPU offload keeps on the host when `offload`)."""
    from transformers import set_seed

    from lowmem_ft.train.trace.layers import Segments, decoder_layers
    from lowmem_ft.train.trace.step import Shadow, _forget, build, install_loss, optimizer_for, run_step

    if recipe.memory.embeddings_on_host:
        raise UserError("--verify --gpus N does not trace memory.embeddings_on_host; plan without --verify")
    shadow = Shadow()
    set_seed(recipe.training.seed)
    model = build(recipe, config, shadow)
    found = decoder_layers(model, config.get_text_config().num_hidden_layers)
    segments = Segments(found[1] if found else None)
    with shadow, quant_state_on_gathered_weights(recipe):
        install_loss(model, recipe)
        shard(model, mesh)
        optimizer = optimizer_for(model, recipe)
        if type(optimizer).__module__.startswith("bitsandbytes"):
            step_on_local_shards(optimizer)
        run_step(model, optimizer, recipe, warmup_seq=warmup_seq, segments=segments, peak_options=PEAK_OPTIONS)
    segments.remove()
    if offload:
        segments.less(_host_shard_bytes(model, optimizer))
    _forget(model)
    del model, optimizer
    gc.collect()
    return segments


def _host_shard_bytes(model, optimizer) -> int:
    """What FSDP2's CPU offload (`CPUOffloadPolicy`, accelerate's `fsdp_offload_params`) keeps in host memory
    through the step: every sharded parameter's local shard, a trainable one's gradient shard of the same size
    (the reduce-scattered gradient is copied to the host), and the optimizer's states, which step there."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def nbytes(t) -> int:
        t = t._local_tensor if isinstance(t, DTensor) else t
        storage = t.untyped_storage()
        key = id(storage)
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()

    total = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            local = nbytes(p)
            total += local + (local if p.requires_grad else 0)
    for state in optimizer.state.values():
        total += sum(nbytes(t) for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


def predict_rank(
    recipe: Recipe, arch, gpus: int, precision: str | None = None, offload: bool = False
) -> dict[str, float]:
    """The memory model's CPU form of one FSDP2 rank's phases (`memory.sharding.fsdp2_phase_bytes`) under the
    mixed precision `trace_rank` shards with (default: the GPU run's)."""
    from dataclasses import replace

    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.memory.sharding import fsdp2_phase_bytes

    # on the CPU nothing is offloaded (`lowmem_ft.train.model._offload`), in the trace as in a CPU run
    s = replace(setup_from_recipe(recipe, device="cpu"), activation_offloading=False)
    precision = mixed_precision(recipe) if precision is None else precision
    return fsdp2_phase_bytes(arch, s, gpus, mixed=precision != "no", offload=offload)


def traced_rank(recipe: Recipe, arch, plan) -> tuple[Trace, dict[str, float], str, list[str]]:
    """For `verify.verify` of a plan over `plan.gpus` devices: (rank 0's trace, its prediction, how it was traced,
    notes), or a UserError saying why the plan cannot be traced."""
    from lowmem_ft.memory.sharding import fsdp_version

    check(recipe, plan.gpus, plan.strategy)
    result = trace_rank(recipe, plan.gpus, offload=plan.offload)
    notes = []
    if fsdp_version(recipe.model.quantization)[0] == 1:
        notes.append(
            "4-bit weights run on FSDP1, which is not traced: traced and predicted are one rank under FSDP2 (as "
            "accelerate's FSDP2 path shards it); the plan's FSDP1 figure rests on its every-phase allowance"
        )
    offloaded = " + CPU offload: the shards, their gradients and optimizer states on the host" if plan.offload else ""
    how = f"rank 0 of {plan.gpus} (FSDP2{offloaded}), {result.how()}"
    return result, predict_rank(recipe, arch, plan.gpus, offload=plan.offload), how, notes
