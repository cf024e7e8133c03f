"""Exact peak of live tensor bytes, on any device (the CPU included): the yardstick of the memory model.

`PeakMemory` is a `TorchDispatchMode` that sees every tensor an operator returns and counts each distinct
storage once, until Python frees it (a weakref callback on the `UntypedStorage`, the mechanism torch's own
`torch.distributed._tools.mem_tracker.MemTracker` uses). Tensors that exist before it starts (weights, quantization
constants, optimizer states) are found once: by walking the garbage collector's objects, or, given `roots` (a run's
model and optimizer), by walking what those objects hold — so tensors of an earlier run still alive in the same
process (a test session) are not counted as this run's. What it cannot see: workspace a kernel allocates and frees
inside one C++ call, and device overheads (CUDA context, allocator rounding) — the estimator's "device overhead"
terms, which the CPU form of the memory model excludes on purpose.

Kernels written in Python (bitsandbytes' CPU optimizer kernels, `bitsandbytes/backends/cpu/ops.py`) are registered
as the CPU kernel of a custom op, and a kernel runs below every dispatch mode, so their fp32 dequantized states and
upcasts would be invisible. `PeakMemory` routes those ops, when their tensors are on the CPU, to the same Python
function with the mode re-entered (`python_cpu_kernels`): the same code runs with the same arguments, and its torch
ops are counted. Nothing in the libraries is patched.

Why not torch's own tools: `torch.cuda.memory._record_memory_history` and the allocator statistics are CUDA-only
(torch 2.13 keeps no CPU allocator statistics: `torch._C._cpu` has none); `torch.profiler(profile_memory=True)` sees
CPU allocations but buffers every event of every operator until it stops (memory grows with the run) and gives no
running peak without post-processing them; `MemTracker` is this same mechanism plus module hooks and misses tensors
that are neither parameters, buffers nor optimizer states (bitsandbytes' quantization constants). The measured cost
of each is in `benchmarks/monitor_overhead.md` (`python -m devkit.bench.monitor_overhead`).

    with PeakMemory() as pm:
        loss = model(**batch).loss; loss.backward(); optimizer.step()
        pm.mark("step")
    pm.peak_bytes, pm.marks
"""

from __future__ import annotations

import gc
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

# Objects whose contents are code or process-wide state, never a run's tensors: the walk from `roots` stops there.
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, str, bytes)


@dataclass
class Mark:
    label: str
    live_bytes: int
    peak_bytes: int  # highest live bytes since the previous mark


class _Ref(weakref.ref):
    """A weak reference to a storage that remembers what it counted, so freeing it needs no lookup but its own."""

    __slots__ = ("key", "nbytes", "log_key")


def python_cpu_kernels() -> dict[Any, Callable]:
    """Custom ops whose CPU kernel is a Python function, mapped to that function (empty while bitsandbytes is not
    imported: then none of its ops can run, and importing it only for this would cost a second and a warning).

    bitsandbytes 0.50 registers these with `register_kernel(op, "cpu")` (backends/cpu/ops.py) and takes each op's
    arguments in the op's schema order, so calling the function is calling the kernel."""
    if "bitsandbytes" not in sys.modules:
        return {}
    try:
        import bitsandbytes  # noqa: F401  (registers the ops)
        from bitsandbytes.backends.cpu import ops as cpu_ops
    except ImportError:
        return {}
    kernels = {}
    for op, name in (
        ("optimizer_update_8bit_blockwise", "_optimizer_update_8bit_blockwise_cpu"),
        ("optimizer_update_32bit", "_optimizer_update_32bit_cpu"),
    ):
        fn = getattr(cpu_ops, name, None)
        overload = getattr(getattr(torch.ops.bitsandbytes, op, None), "default", None)
        if fn is not None and overload is not None:
            kernels[overload] = fn
    return kernels


def reachable_tensors(roots: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every tensor the `roots` hold: through attributes, containers (dict keys too: optimizer states are keyed by
    parameter), and parameters' gradients; not through code, classes or modules (process-wide state)."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            if obj is None or isinstance(obj, _OPAQUE):
                continue
            if isinstance(obj, torch.Tensor):
                yield obj
                if obj.is_leaf and obj.grad is not None:
                    stack.append(obj.grad)
            if isinstance(obj, dict):
                stack.extend(obj.keys())
                stack.extend(obj.values())
            elif isinstance(obj, (list, tuple, set, frozenset)):
                stack.extend(obj)
            attributes = vars(obj)
        except (TypeError, ReferenceError):  # no __dict__ (slots, builtins), or a dead weak proxy
            continue
        except RuntimeError:  # `.grad` of a view autograd refuses to read (FSDP1's views of a flat parameter)
            continue
        if isinstance(attributes, dict):
            stack.extend(attributes.values())


@dataclass
class PeakMemory(TorchDispatchMode):
    device: str | None = None  # count only storages on this device type ("cpu", "cuda"); None counts all
    roots: list | None = None  # find pre-existing tensors from these objects (None: every object the gc knows)
    live_bytes: int = 0
    peak_bytes: int = 0
    marks: list[Mark] = field(default_factory=list)
    # When a list: every storage's allocation ("+", key, bytes) and free ("-", key, bytes), and each mark ("mark",
    # label, 0), in the order they happen — the input of `lowmem_ft.train.measure.allocator` (key: the storage's id while it
    # lives). None (the default) records nothing and costs one test per new storage.
    log: list[tuple[str, object, int]] | None = None
    # Count storages that change size in place (`UntypedStorage.resize_`, which no dispatch mode sees): FSDP2
    # gathers a unit into parameters whose storages it grows and shrinks so (torch/distributed/fsdp/_fully_shard/
    # _fsdp_param.py `alloc_storage` / `free_storage`). Done as torch's own `MemTracker._track_resize` does it
    # (torch/distributed/_tools/mem_tracker.py): `resize_` is wrapped while the mode is active, for every caller.
    storage_resizes: bool = False
    # A traced step (`lowmem_ft.train.trace`): its fake tensors' storages are on the meta device; with
    # `storage_resizes`, a meta storage resized in place is counted as a CPU one (no step of a trace has real ones).
    fake_storages: bool = False

    def __post_init__(self):
        super().__init__()
        self._live: dict[int, _Ref] = {}  # id of a live storage → its reference
        self._resized_key = 0  # the log's keys for resized storages' new blocks: -1, -2, ...
        self._window_peak = 0
        self._kernels: dict[Any, Callable] = {}
        self._depth = 0
        self._cpu_only = self.device == "cpu"  # the common case, tested without building a torch.device

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def _track(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            # a wrapper without storage of its own (a DTensor: FSDP2's sharded parameters, their gradients and
            # optimizer states): its inner tensors hold the bytes, and ops on it run below this mode
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)
            return
        if self._cpu_only:
            if not tensor.is_cpu:  # meta tensors too
                return
        elif tensor.is_meta or (self.device is not None and tensor.device.type != self.device):
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # tensor subclasses without a storage
            return
        nbytes = storage.nbytes()
        ref = self._live.get(id(storage))
        if ref is not None:
            if ref.nbytes == nbytes:
                return
            self.live_bytes += nbytes - ref.nbytes  # resized in place
            if self.log is not None:  # resizing allocates the new size, copies, then frees the old (as on CUDA)
                self._resized_key -= 1  # a key no live storage's id can be
                self.log += (("+", self._resized_key, nbytes), ("-", ref.log_key, ref.nbytes))
                ref.log_key = self._resized_key
            ref.nbytes = nbytes
        else:
            # The callback runs when the storage's Python object is freed, before its id can be reused; torch keeps
            # one Python object per storage for as long as the storage lives (PyObject preservation).
            ref = _Ref(storage, self._freed)
            ref.key, ref.nbytes = id(storage), nbytes
            ref.log_key = ref.key
            self._live[ref.key] = ref
            self.live_bytes += nbytes
            if self.log is not None:
                self.log.append(("+", ref.key, nbytes))
        if self.live_bytes > self._window_peak:
            self._window_peak = self.live_bytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes

    def _storage_resized(self, storage: torch.UntypedStorage) -> None:
        """After `storage.resize_(n)`: count its new size (a storage first seen here is new)."""
        fake = self.fake_storages and storage.device.type == "meta"
        if self._cpu_only and storage.device.type != "cpu" and not fake:
            return
        nbytes = storage.nbytes()
        ref = self._live.get(id(storage))
        if ref is None:
            ref = _Ref(storage, self._freed)
            ref.key, ref.nbytes, ref.log_key = id(storage), 0, id(storage)
            self._live[ref.key] = ref
            if self.log is not None:
                self.log.append(("+", ref.key, 0))
        if ref.nbytes == nbytes:
            return
        self.live_bytes += nbytes - ref.nbytes
        if self.log is not None:
            self._resized_key -= 1
            self.log += (("+", self._resized_key, nbytes), ("-", ref.log_key, ref.nbytes))
            ref.log_key = self._resized_key
        ref.nbytes = nbytes
        if self.live_bytes > self._window_peak:
            self._window_peak = self.live_bytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _freed(self, ref: _Ref) -> None:
        self.live_bytes -= ref.nbytes
        if self._live.pop(ref.key, None) is not None and self.log is not None:
            self.log.append(("-", ref.log_key, ref.nbytes))

    def window(self) -> tuple[int, int]:
        """(live bytes now, the peak since the previous window or mark), and start the next window."""
        live = self.live_bytes
        peak = max(self._window_peak, live)
        self._window_peak = live
        return live, peak

    def mark(self, label: str) -> Mark:
        """Record live bytes now and the peak since the previous mark (kept in `marks`)."""
        m = Mark(label, *self.window())
        self.marks.append(m)
        if self.log is not None:
            self.log.append(("mark", label, 0))
        return m

    def reset_peak(self) -> None:
        self.peak_bytes = self._window_peak = self.live_bytes

    def _existing(self) -> Iterable[Any]:
        if self.roots is not None:
            return reachable_tensors(self.roots)
        gc.collect()
        return gc.get_objects()

    # -- TorchDispatchMode ---------------------------------------------------------------------------------------
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's `__torch_dispatch__` in `torch._disable_dynamo` unless told otherwise; nothing here is
        # compiled, and the wrapper costs ~1.3 µs of every operator (benchmarks/monitor_overhead.md, per operator).
        return False

    def __enter__(self):
        self._depth += 1
        if self._depth > 1:  # re-entered to run a Python kernel (`__torch_dispatch__`): already counting
            return super().__enter__()
        self._kernels = python_cpu_kernels()  # the run's libraries are imported by now
        if self.storage_resizes:
            self._resize = torch.UntypedStorage.resize_
            original, counted = self._resize, self._storage_resized

            def resize_(storage, size):
                out = original(storage, size)
                counted(storage)
                return out

            torch.UntypedStorage.resize_ = resize_
        with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
            warnings.simplefilter("ignore")
            for obj in self._existing():
                try:
                    if isinstance(obj, torch.Tensor):
                        self._track(obj)
                except ReferenceError:  # a dead weakproxy
                    continue
        self.reset_peak()
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            if self.storage_resizes:
                torch.UntypedStorage.resize_ = self._resize
            self._live.clear()  # stop counting: let go of the references (and their callbacks)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kernel = self._kernels.get(func)
        if kernel is not None and all(t.is_cpu for t in tree_leaves(args) if isinstance(t, torch.Tensor)):
            with self:  # the kernel's own torch ops, counted like any others
                return kernel(*args, **kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self._track(out)
        elif isinstance(out, (tuple, list)):  # several outputs; foreach ops return lists
            for item in out:
                if isinstance(item, torch.Tensor):
                    self._track(item)
                elif isinstance(item, (tuple, list, dict)):
                    for leaf in tree_leaves(item):
                        if isinstance(leaf, torch.Tensor):
                            self._track(leaf)
        return out


def trainer_optimizer(model, args):
    """The optimizer transformers' `Trainer.create_optimizer` builds for `args.optim`, with its bitsandbytes override:
    every `nn.Embedding` weight keeps 32-bit states under an 8-bit optimizer (trainer.py), as in a real run."""
    import torch
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = cls([q for q in model.parameters() if q.requires_grad], **kwargs)
    if "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        # each point starts clean: bitsandbytes keeps overrides process-wide, by parameter position
        # (index2config), so an earlier point's embedding override would apply to whatever sits there now
        manager.initialize()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


# (optimizer step, micro-step): step 1 with accumulation 1, step 2 with accumulation 2 — so in micro-step 2.2 the
# optimizer states and the accumulated gradients exist beside the activations, as in a steady-state step
STEPS = ((1, 1), (2, 1), (2, 2))


def measured_step(
    pm: PeakMemory,
    batches: Iterable[Any],
    forward: Callable[[Any], tuple[torch.Tensor, Any]],
    optimizer,
    trainable: list[torch.Tensor],
    max_grad_norm: float = 1.0,
) -> None:
    """The two optimizer steps of `STEPS` under `pm`, marked as the memory model's phases: "forward n.k" (after
    `forward(batch)`), "backward n.k" (after the loss's backward), "optimizer n" (clip + step + zero_grad).

    `batches`: one per micro-step. `forward(batch)` → (the loss, what the step holds until its backward ends: the
    model's outputs). The one step loop of the accuracy harnesses, the tracer and the preference grid: each gives
    its own batches and loss (SFTTrainer's fused-head loss, or a TRL preference trainer's `compute_loss`)."""
    for (step, micro), batch in zip(STEPS, batches, strict=True):
        loss, held = forward(batch)
        pm.mark(f"forward {step}.{micro}")
        loss.backward()
        del loss, held
        pm.mark(f"backward {step}.{micro}")
        if micro == step:  # step 1: accumulation 1; step 2: accumulation 2
            torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pm.mark(f"optimizer {step}")


def fused_head_loss(model, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """SFTTrainer's loss on a `(input_ids, attention_mask, labels)` batch, through TRL's fused LM head
    (`trl.trainer.utils.add_fused_lm_head` installed): the mean negative log-probability of the labelled tokens."""
    ids, mask, labels = batch
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return -out.log_probs.sum() / out.label_mask.sum().clamp(min=1), out  # SFTTrainer.compute_loss
