"""The real training step at full size, on the CPU, without weights: peak live tensor bytes per phase.

`trace` builds the recipe's model from its config alone through the path `train` uses (transformers'
`from_pretrained`, with a state dict of tensors that have shapes but no storage; `prepare_for_training`,
`attach_adapter`, `apply_memory_savers`; the loss head `train` installs; the optimizer transformers' Trainer builds),
then runs the step the CPU yardstick runs (`devkit.harness.estimator.measure`: two optimizer steps, the second with
an accumulation window of two micro batches, the last at the full batch) and an evaluation forward, under
`lowmem_ft.train.measure.peak.PeakMemory` — the same live-tensor accounting as a CPU run, counting each storage once.

The one idea: data runs for real, weights and activations run fake. `Shadow` is a dispatch mode under which an
operator whose inputs are all real tensors (token ids, attention masks, labels, position ids, optimizer step
counters) runs for real when its result is small, and every operator that touches a fake tensor runs under
torch's `FakeTensorMode` (shapes, dtypes and devices, no storage). So every decision the libraries take from
data — whether transformers may skip the attention mask (`masking_utils._ignore_causal_mask_sdpa` reads
`padding_mask.all()`), which positions carry labels, the optimizer's step count — is taken on the real values, as
in a real run: a fake attention mask would make transformers take its tracing path (`is_tracing` is true for a
FakeTensor) and build a mask the real run skips. The attention kernel is the one the real run picks
(`_scaled_dot_product_flash_attention_for_cpu`: the dispatcher decides it from the inputs' device and dtype, which
fake tensors keep).

Why our own, not torch's `torch.distributed._tools.mem_tracker.MemTracker` under `FakeTensorMode`: MemTracker
attributes bytes to modules and categories and misses tensors that are neither parameters, buffers, gradients nor
optimizer states (bitsandbytes' quantization constants); a plain `FakeTensorMode` fails on every data-dependent
read (`.item()`, `.tolist()`: bitsandbytes' code maps, the optimizer's step) and takes transformers' tracing paths;
and neither runs `train`'s build path. Here the accounting is the CPU measurement's own, so trace and measurement
differ only where execution does.

Depth: a model with more decoder layers than needed is traced at two small depths (e.g. 2 and 3 of 32 layers) and
extrapolated to its own, exactly, as every byte count is affine in the number of repeating layers
(`lowmem_ft.train.trace.layers`); `Trace.how()` says which depths were traced.

bitsandbytes: its operators have fake kernels (`bitsandbytes/_ops.py`), so quantizing, dequantizing and the 8-bit
optimizer's update run under fake tensors; its parameter classes (`Params4bit`, `Int8Params`) cannot hold a fake
tensor (`Tensor._make_subclass` refuses a tensor that is already a FakeTensor). So a quantized layer's weight is
the fake packed tensor bitsandbytes' own `quantize_4bit` / `int8_vectorwise_quant` returns, carrying the attributes
its layers and peft read (`quant_state`, `quant_type`, `SCB`, ...) — the same bytes as the real parameter
(measured against real NF4 layers on the zoo, `tests/train/trace/test_step.py`).
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import Recipe
from lowmem_ft.train import methods
from lowmem_ft.train.trace.layers import Layers

log = logging.getLogger(__name__)

# The largest result an all-real operator may produce and still run for real (bytes): data-sized tensors (ids,
# masks, labels, a b×s² attention mask up to this size) stay real; larger results run fake, so a long-context mask
# costs no host memory.
REAL_LIMIT = 64 << 20

_METADATA = {torch.ops.prim.device.default, torch.ops.prim.layout.default}
# Indexing fake data with real boolean masks (`hidden[labels != -100]`, and its backward): the kernel turns a mask
# into the positions it selects, which fake tensors cannot (data-dependent shapes); the mask is real, so the
# positions are computed for real, as the kernel does inside the one operator.
_INDEXING = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}


def _long_indices(indices: list) -> list:
    out = []
    for index in indices:
        if isinstance(index, torch.Tensor) and not isinstance(index, FakeTensor) and index.dtype == torch.bool:
            out.extend(index.nonzero(as_tuple=True))
        else:
            out.append(index)
    return out


# phase labels of `trace`, in order (the yardstick's, `devkit.harness.estimator.measure`, plus "eval")
STEPS = ((1, 1), (2, 1), (2, 2))
# A run with one micro batch per optimizer step (`gradient_accumulation` 1), for `allocation_log`: step 1 makes the
# optimizer's states, step 2 runs the full batch without gradients before it, as such a run's every step does. Its
# one micro batch keeps the label 2.2, the full batch's in `STEPS`.
ONE_MICRO_BATCH = ((1, 1), (2, 2))


def _storage_bytes(out: Any) -> int:
    total = 0
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            try:
                total += t.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):
                continue
    return total


class Shadow(TorchDispatchMode):
    """Run data for real and everything else fake (see the module docstring). Meta-device work (transformers
    builds the model skeleton on the meta device before loading) stays on the meta device."""

    def __init__(self):
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled: no `torch._disable_dynamo` wrapper around every operator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:  # a tensor's device or layout: answered by the tensor itself (fake or real)
            return func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in leaves):
            if func in _INDEXING:
                args = (args[0], _long_indices(args[1]), *args[2:])
            return self._mixed(func, args, kwargs)
        if any(t.is_meta for t in leaves):
            return func(*args, **kwargs)
        try:
            with self.fake:
                probe = func(*args, **kwargs)
        except Exception:  # noqa: BLE001 — data-dependent (nonzero, .item()) or no fake kernel: real inputs, run real
            return func(*args, **kwargs)
        if all(not t.is_meta for t in tree_leaves(probe) if isinstance(t, torch.Tensor)) and (
            _storage_bytes(probe) > REAL_LIMIT
        ):
            return probe
        return func(*args, **kwargs)

    def _mixed(self, func, args, kwargs):
        """An operator on fake tensors (and maybe real ones) runs fake. A real tensor it writes into (`addmm_(...,
        out=buffer)`, an in-place update of a real buffer) is the result, as in a real run, not a fake copy: the
        copy would be a new storage, counted twice. Its values go stale; only buffers for fake data are written so."""
        if not func._schema.is_mutable:
            with self.fake:
                return func(*args, **kwargs)
        real: dict[int, torch.Tensor] = {}

        def to_fake(t):
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and not t.is_meta:
                fake = self.fake.from_tensor(t)
                real[id(fake)] = t
                return fake
            return t

        args, kwargs = tree_map(to_fake, (args, kwargs))
        with self.fake:
            out = func(*args, **kwargs)
        return tree_map(lambda t: real.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)

    def fake_tensor(self, shape, dtype) -> torch.Tensor:
        with self.fake:
            return torch.empty(shape, dtype=dtype)


# -- building ------------------------------------------------------------------------------------------------------
def _model_class(config):
    """The class `train` loads: `lowmem_ft.train.model.auto_class` (the image-text class for a vision-language
    checkpoint, Qwen2.5-VL's or Gemma-3's, else the causal LM one)."""
    from lowmem_ft.train.model import auto_class

    try:
        return auto_class(config)._model_mapping[type(config)]
    except KeyError:
        raise UserError(
            f"cannot trace model_type {config.model_type!r}: transformers {_version('transformers')} has no causal "
            "LM class for it (a model with its own code cannot be traced)"
        ) from None


def _version(package: str) -> str:
    from lowmem_ft.versions import installed

    return installed(package) or "?"


def _state_dict_shapes(cls, config, dtype) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The checkpoint's tensors (name → shape, dtype) as the model class declares them, built on the meta device."""
    with torch.device("meta"):
        model = cls(config)
    model.to(dtype)
    shapes, seen = {}, set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:  # a tied weight (lm_head = embed_tokens): saved once, as save_pretrained saves it
            continue
        seen.add(id(value))
        shapes[key] = (value.shape, value.dtype)
    return shapes


def _quantize(model, recipe: Recipe, shadow: Shadow) -> None:
    """The recipe's bitsandbytes storage on every layer transformers' quantizer would convert (see the module
    docstring for why the weights are fake packed tensors rather than `Params4bit` / `Int8Params`)."""
    import bitsandbytes as bnb
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    from lowmem_ft.train.model import quantization_config

    q = quantization_config(recipe)
    modules_to_not_convert = ["lm_head", *(q.llm_int8_skip_modules or [])]
    old = {n: (m.weight, m.bias) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    with torch.device("meta"):  # the layers' own weights are replaced below; build them empty
        replace_with_bnb_linear(model, modules_to_not_convert=modules_to_not_convert, quantization_config=q)
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight, bias = old[name]
            # from the weight's data, as transformers' quantizer packs loaded weights: packed from the parameter
            # itself (which requires grad until `prepare_for_training`), the quantization state (absmax) would
            # require grad, and so would every output of the layer — a frozen tower's activations kept for a
            # backward that a real run never records (Gemma-3-12B's NF4 SigLIP: each layer's hidden states, 2 GB)
            weight = weight.detach()
            with shadow:
                packed, state = bnb.functional.quantize_4bit(
                    weight,
                    blocksize=module.weight.blocksize,
                    compress_statistics=q.bnb_4bit_use_double_quant,
                    quant_type=q.bnb_4bit_quant_type,
                    quant_storage=q.bnb_4bit_quant_storage,
                )
            param = torch.nn.Parameter(packed, requires_grad=False)
            for key, value in vars(module.weight).items():
                if not key.startswith("_"):
                    setattr(param, key, value)
            param.quant_state, param.bnb_quantized, param.module = state, True, module
            module._parameters["weight"] = param
            module.quant_state = state
        elif isinstance(module, bnb.nn.Linear8bitLt):
            weight, bias = old[name]
            weight = weight.detach()  # as for Linear4bit above
            with shadow:
                cb, scb, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
            param = torch.nn.Parameter(cb, requires_grad=False)
            param.CB, param.SCB, param.has_fp16_weights = cb, scb, False
            module._parameters["weight"] = param
            module.state.CB, module.state.SCB = cb, scb
        else:
            continue
        if bias is not None:
            module._parameters["bias"] = bias
    model.is_loaded_in_4bit = recipe.model.quantization == "nf4"
    model.is_loaded_in_8bit = recipe.model.quantization == "int8"


def build(recipe: Recipe, config, shadow: Shadow):
    """`lowmem_ft.train.model.build_model` without weights: the base from `config` with fake weights in the
    recipe's storage, then the same preparation, adapters and memory savers."""
    from lowmem_ft.train.model import HUB_KERNELS_OFF, attach_adapter, attention, prepare_for_training, torch_dtype
    from lowmem_ft.train.savers.apply import apply_memory_savers
    from lowmem_ft.vision.tower import freeze_tower_inputs

    if recipe.adapter.name_or_path:
        raise UserError("cannot trace a run that continues a saved adapter (--adapter); trace without it")
    dtype = torch_dtype(recipe.model.compute_dtype)
    cls = _model_class(config)
    shapes = _state_dict_shapes(cls, config, dtype)
    state = {k: shadow.fake_tensor(shape, d) for k, (shape, d) in shapes.items()}  # weights: fake at any size
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # no loading bar nor "newly initialized" lines: there are no weights
    transformers.logging.disable_progress_bar()
    # transformers loads on worker threads unless told not to; a dispatch mode is the entering thread's alone
    threads = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        with shadow:
            model = cls.from_pretrained(
                None,
                config=config,
                state_dict=state,
                dtype=dtype,
                attn_implementation=attention(recipe, config),
                **HUB_KERNELS_OFF,
            )
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
        if threads is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD")
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = threads
    del state
    if recipe.model.quantization != "none":
        _quantize(model, recipe, shadow)
    with shadow:
        model = prepare_for_training(model, recipe)
        model = attach_adapter(model, recipe)
        apply_memory_savers(model, recipe)
    freeze_tower_inputs(model)  # as `build_model`: a vision tower's input needs no grad (lowmem_ft.vision.tower)
    _fake_tensors_of(model, shadow)
    return model


def _fake_tensors_of(model, shadow: Shadow) -> None:
    """Make the parameters and buffers that came out real (small ones: LoRA weights, norms, rotary frequencies)
    fake: the same bytes, and nothing the optimizer or the layers compute from them runs for real (on an 8B LoRA
    the real adapters made the trace several times slower, converting each to fake at every use)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or isinstance(t, FakeTensor) or t.is_meta:
                    continue
                fake = shadow.fake.from_tensor(t.detach())
                if isinstance(t, torch.nn.Parameter):
                    param = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
                    param.__dict__.update(t.__dict__)
                    table[name] = param
                else:
                    table[name] = fake


def install_loss(model, recipe: Recipe) -> None:
    """The loss `train` installs: TRL's fused LM head (as `SFTTrainer.__init__` adds it), ours when chunked or over
    the full logits (`memory.full_logits_loss`), as `lowmem_ft.train.run` installs them after the trainer."""
    from trl.trainer.utils import add_fused_lm_head

    from lowmem_ft.train.losses import install_loss_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
    if recipe.memory.chunked_loss:
        install_loss_head(model, chunked=True, chunk_tokens=recipe.memory.loss_chunk_tokens or None)
    elif recipe.memory.full_logits_loss:
        install_loss_head(model, chunked=False)


def optimizer_for(model, recipe: Recipe):
    """The optimizer transformers' `Trainer.create_optimizer` builds for the recipe, with its bitsandbytes override
    (every `nn.Embedding` keeps 32-bit states under an 8-bit optimizer)."""
    from transformers import TrainingArguments

    from lowmem_ft.train.args import OPTIM_NAMES
    from lowmem_ft.train.measure.peak import trainer_optimizer

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim=OPTIM_NAMES[recipe.optimizer.name], use_cpu=True)
    return trainer_optimizer(model, args)


def batches(vocab: int, rows: int, lengths: list[int], seed: int = 1) -> Iterator[tuple[torch.Tensor, ...]]:
    """Real micro batches (input_ids, attention_mask, labels) of `lengths` tokens, one made ahead as the CPU
    loader makes it, one row of a padded batch masked at its start: those of `devkit.harness.estimator`."""
    gen = torch.Generator().manual_seed(seed)

    def make(seq: int):
        ids = torch.randint(0, vocab, (rows, seq), generator=gen)
        mask = torch.ones_like(ids)
        if rows > 1:
            mask[-1, : seq // 4] = 0
        return ids, mask, ids.clone()

    ahead = [make(lengths[0])]
    for i in range(len(lengths)):
        ahead.append(make(lengths[min(i + 1, len(lengths) - 1)]))
        yield ahead.pop(0)


@dataclass
class Trace:
    """Peak live bytes per phase of a traced step: `marks` label → (peak within it, live at its end), the labels of
    `devkit.harness.estimator.measure` ("static", "forward n.k", "backward n.k", "optimizer n") and "eval"."""

    marks: dict[str, tuple[int, int]] = field(default_factory=dict)
    seconds: float = 0.0
    host_bytes: int = 0  # the input embedding table kept in host memory (memory.embeddings_on_host), not counted
    depth: Layers | None = None  # traced at two smaller depths and extrapolated (None: traced whole)
    images: Any = None  # the image sample every micro batch carried (`lowmem_ft.train.trace.images.ImageSample`)

    def how(self) -> str:
        """How the trace was made, for the user: whole, or from which depths (and with which images)."""
        if self.depth is None:
            how = "traced whole"
        else:
            small, large = self.depth.traced
            how = f"traced at {small} and {large} of {self.depth.total} decoder layers and extrapolated"
        if self.images is not None:
            how += f" (the vision tower whole; images: {self.images.source}, {self.images.patches} patches a sample)"
        return how

    @property
    def phases(self) -> dict[str, int]:
        """The steady-state step's peaks, as the memory model's phases (micro-step 2.2: states and accumulated
        gradients exist)."""
        m = self.marks
        out = {
            "static": m["backward 2.1"][1],
            "forward": m["forward 2.2"][0],
            "backward": m["backward 2.2"][0],
            "optimizer step": m["optimizer 2"][0],
        }
        if "eval" in m:
            out["eval"] = m["eval"][0]
        return out

    @property
    def peak(self) -> int:
        return max(peak for label, (peak, _) in self.marks.items() if label != "eval")


def _text_batches(vocab: int, rows: int, lengths: list[int]) -> Iterator[dict[str, torch.Tensor]]:
    for ids, mask, labels in batches(vocab, rows, lengths):
        yield {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run_step(
    model, optimizer, recipe: Recipe, *, warmup_seq: int = 8, eval_rows: int = 0, segments=None, log=None,
    images=None, peak_options: dict | None = None, steps: tuple = STEPS,
) -> dict:  # fmt: skip
    """Two optimizer steps (accumulation 1, then 2; the full batch in micro-step 2.2), then an evaluation forward of
    `eval_rows` rows (0: none), under `PeakMemory`; real or fake, whatever `model` holds. label → (peak, live).
    `segments` (`trace_layers.Segments`): also each mark's peak before, inside and after the decoder stack.
    `log` (a list): `PeakMemory`'s allocation log of the step is appended to it (`lowmem_ft.train.measure.allocator`).
    `images` (`lowmem_ft.train.trace.images.ImageSample`): every micro batch is the plan's image sample at the full
    batch (the tower, and its adapters under vision.train lora / full, run in every step, as in a run).
    `peak_options`: more `PeakMemory` settings (`lowmem_ft.train.trace.sharded` counts FSDP2's storage resizes).
    `steps`: the (optimizer step, micro batch) sequence, `STEPS` or `ONE_MICRO_BATCH`; an optimizer step follows
    the micro batch whose numbers are equal, and (2, 2) is the full batch."""
    from contextlib import nullcontext

    from lowmem_ft.train.measure.peak import PeakMemory

    m = recipe.memory
    trainable = [q for q in model.parameters() if q.requires_grad]
    vocab = model.config.get_text_config().vocab_size
    lengths = [m.max_seq_len if s == (2, 2) else warmup_seq for s in steps]
    if images is None:
        micro_batches = _text_batches(vocab, m.micro_batch_size, lengths)
    else:
        micro_batches = images.batches(m.micro_batch_size, m.max_seq_len, len(steps))
    model.train()
    with PeakMemory(device="cpu", roots=[model, optimizer.state], log=log, **(peak_options or {})) as pm:
        mark = pm.mark if segments is None else lambda label: segments.mark(pm, label)
        watch = (lambda backward: nullcontext()) if segments is None else lambda backward: segments.watch(pm, backward)
        mark("static")
        for (step, micro), batch in zip(steps, micro_batches, strict=True):
            with watch(False):
                out = model(**batch, fused_lm_head=True)
                loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)  # SFTTrainer.compute_loss
            mark(f"forward {step}.{micro}")
            with watch(True):
                loss.backward()
            del out, loss
            mark(f"backward {step}.{micro}")
            if micro == step:
                torch.nn.utils.clip_grad_norm_(trainable, recipe.optimizer.max_grad_norm or 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                mark(f"optimizer {step}")
        if eval_rows:
            model.eval()
            ids, mask, labels = next(batches(vocab, eval_rows, [m.max_seq_len]))
            with torch.no_grad(), watch(False):  # SFTTrainer.prediction_step → compute_loss: the fused head too
                out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
                loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)
                del out, loss
            mark("eval")
            model.train()
    return {mark.label: (mark.peak_bytes, mark.live_bytes) for mark in pm.marks}


def trace(recipe: Recipe, config=None, *, eval_rows: int = 0, warmup_seq: int = 8, whole: bool = False) -> Trace:
    """Trace `recipe`'s training step at its full batch (micro_batch_size × max_seq_len) without weights.

    `config`: the model's transformers config (default: read from `recipe.model.name_or_path`, config.json only).
    Unless `whole`, a model with more decoder layers than the trace needs is traced at two smaller depths and
    extrapolated to its own (`lowmem_ft.train.trace.layers`: exact, as the bytes are affine in the depth)."""
    from lowmem_ft.train.model import torch_dtype
    from lowmem_ft.train.trace import layers as trace_layers

    if recipe.model.trust_remote_code:
        raise UserError("cannot trace a model that runs its own code (--trust-remote-code): trace needs a model class "
                        "transformers ships")  # fmt: skip
    if not methods.get(recipe.training.method).traced:
        raise UserError(f"--verify traces supervised fine-tuning steps; training.method={recipe.training.method} is "
                        "not traced yet (plan without --verify)")  # fmt: skip
    from lowmem_ft.train.trace.images import image_sample

    started = time.perf_counter()
    config = config if config is not None else model_config(recipe)
    images = image_sample(recipe)
    if images is not None:  # a vision-language run evaluates nothing (`VisionSetup.prepare`: no eval split)
        eval_rows = 0
    depth = None if whole else trace_layers.plan(_model_class(config), config, torch_dtype(recipe.model.compute_dtype))
    if depth is None:
        segments, host = _traced(recipe, config, eval_rows, warmup_seq, images=images)
        return Trace(segments.marks(), time.perf_counter() - started, host, images=images)
    small, host = _traced(recipe, trace_layers.truncated(config, depth.first), eval_rows, warmup_seq, images=images)
    large, _ = _traced(
        recipe, trace_layers.truncated(config, depth.first + depth.period), eval_rows, warmup_seq, images=images
    )
    return Trace(depth.extrapolate_marks(small, large), time.perf_counter() - started, host, depth, images)


def allocation_log(
    recipe: Recipe, config, layers: int | None = None, *, eval_rows: int = 0, warmup_seq: int = 8, steps=STEPS
):
    """The traced step's allocation log (`PeakMemory(log=...)`: each storage's allocation and free, in order, and
    the phase marks), with the model cut to its first `layers` decoder layers (None: whole), for
    `lowmem_ft.train.measure.allocator`; `steps` as `run_step` takes them. The tensors that exist when the step
    starts (weights, adapters) come first, in the order `PeakMemory` finds them; the host embedding table
    (`embeddings_on_host`) is in it too."""
    from lowmem_ft.train.trace import layers as trace_layers

    log: list = []
    cut = config if layers is None else trace_layers.truncated(config, layers)
    _traced(recipe, cut, eval_rows, warmup_seq, log=log, steps=steps)
    return log


def _traced(recipe: Recipe, config, eval_rows: int, warmup_seq: int, log: list | None = None, images=None, steps=STEPS):
    """One trace of the model `config` describes, as it is: `trace_layers.Segments` (each mark's peak before,
    inside and after the decoder stack, host bytes taken out) and the host bytes. `images`: the image sample every
    micro batch carries (`lowmem_ft.train.trace.images`)."""
    from transformers import set_seed

    from lowmem_ft.train.trace.layers import Segments, decoder_layers

    shadow = Shadow()
    set_seed(recipe.training.seed)
    model = build(recipe, config, shadow)
    text = config.get_text_config()
    found = decoder_layers(model, text.num_hidden_layers)
    segments = Segments(found[1] if found else None)
    with shadow:
        install_loss(model, recipe)
        optimizer = optimizer_for(model, recipe)
        run_step(model, optimizer, recipe, warmup_seq=warmup_seq, eval_rows=eval_rows, segments=segments, log=log,
                 images=images, steps=steps)  # fmt: skip
    host = _host_table_bytes(model) if recipe.memory.embeddings_on_host else 0
    segments.remove()
    _forget(model)
    del model, optimizer
    gc.collect()
    return segments.less(host), host


def _host_table_bytes(model) -> int:
    """The input embedding table `embeddings_on_host` keeps in host memory: on this CPU-only trace host and device
    are one memory, so its bytes are taken out of every figure (as `devkit.harness.long_context` does)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_input_embeddings().weight.untyped_storage().nbytes()


def _forget(model) -> None:
    from lowmem_ft.train.model import forget_bnb_overrides

    forget_bnb_overrides(model)


def with_batch(recipe: Recipe, rows: int, seq: int) -> Recipe:
    return replace(recipe, memory=replace(recipe.memory, micro_batch_size=rows, max_seq_len=seq))


def model_config(recipe: Recipe):
    """The transformers config of the recipe's model from config.json alone (a local directory, the offline
    catalog, or the Hub), or a UserError saying why it cannot be traced."""
    from transformers import AutoConfig

    from lowmem_ft.memory.arch import load_config_dict

    name = recipe.model.name_or_path
    if recipe.model.trust_remote_code:
        raise UserError(f"cannot trace {name}: it runs its own code (--trust-remote-code); trace needs a model class "
                        "transformers ships")  # fmt: skip
    config, source = load_config_dict(name)
    if config.get("auto_map"):
        raise UserError(
            f"cannot trace {name}: its config.json names its own code (auto_map), which tracing does not run"
        )
    try:
        return AutoConfig.for_model(**config)
    except (KeyError, ValueError) as exc:
        raise UserError(
            f"cannot trace {name}: transformers {_version('transformers')} cannot build its config from {source} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        ) from None
