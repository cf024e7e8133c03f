"""Exact peak of live tensor bytes, on any device (the CPU included): the yardstick of the memory model.

`PeakMemory` is a `TorchDispatchMode` that sees every tensor an operator returns and counts each distinct
storage once, until Python frees it (a weakref callback on the `UntypedStorage`, the mechanism torch's own
`torch.distributed._tools.mem_tracker.MemTracker` uses). Tensors that exist before it starts (weights, quantization
constants, optimizer states) are found once by walking the garbage collector's objects. What it cannot see:
workspace a kernel allocates and frees inside one C++ call, and device overheads (CUDA context, allocator rounding)
— the estimator's "device overhead" terms, which the CPU harness excludes on purpose.

    with PeakMemory() as pm:
        loss = model(**batch).loss; loss.backward(); optimizer.step()
        pm.mark("step")
    pm.peak_bytes, pm.marks
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary, weakref


@dataclass
class Mark:
    label: str
    live_bytes: int
    peak_bytes: int  # highest live bytes since the previous mark


@dataclass
class PeakMemory(TorchDispatchMode):
    device: str | None = None  # count only storages on this device type ("cpu", "cuda"); None counts all
    live_bytes: int = 0
    peak_bytes: int = 0
    marks: list[Mark] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list = []
        self._window_peak = 0

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def _track(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return
        if self.device is not None and tensor.device.type != self.device:
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # tensor subclasses without a storage
            return
        nbytes = storage.nbytes()
        known = self._sizes.get(storage)
        if known is not None:
            if known != nbytes:  # resized in place
                self._sizes[storage] = nbytes
                self._add(nbytes - known)
            return
        self._sizes[storage] = nbytes
        self._refs.append(weakref.ref(storage, self._release(nbytes)))
        self._add(nbytes)

    def _release(self, nbytes: int):
        def callback(_ref):
            self.live_bytes -= nbytes

        return callback

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._window_peak = max(self._window_peak, self.live_bytes)

    def mark(self, label: str) -> Mark:
        """Record live bytes now and the peak since the previous mark."""
        m = Mark(label, self.live_bytes, self._window_peak)
        self.marks.append(m)
        self._window_peak = self.live_bytes
        return m

    def reset_peak(self) -> None:
        self.peak_bytes = self._window_peak = self.live_bytes

    # -- TorchDispatchMode ---------------------------------------------------------------------------------------
    def __enter__(self):
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                try:
                    if isinstance(obj, torch.Tensor):
                        self._track(obj)
                except ReferenceError:  # a dead weakproxy
                    continue
        self.reset_peak()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out
