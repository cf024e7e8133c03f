"""A simulated GPU for the fast tests: torch.cuda's memory figures and NVML answered by a model of one device.

What reads a GPU's memory in lowmem-ft reads it through two doors: `torch.cuda` (the caching allocator's allocated,
reserved and peak bytes; `mem_get_info`) and NVML (`pynvml`: the device's name, the driver, the device's used
bytes). `SimulatedGPU.install(monkeypatch)` answers both from a model of one device, so the product code runs its
own path — the monitor's `MemoryReader`, the calibration recorder, `lowmem_ft.calibrated.this_device`, `plan`'s
margin — with no branch of its own for tests:

- the allocations a test makes (`malloc` / `free`, or `step`: one training step's phases) go through
  `lowmem_ft.train.measure.allocator.Allocator`, the replay of torch's `DeviceCachingAllocator`, so reserved exceeds
  allocated as the real rules make it (2 MiB / 20 MiB segments, blocks split and cached);
- NVML's used bytes are the CUDA context (`context_bytes`, outside the allocator) plus what the allocator reserved;
- `reset_peak_memory_stats` starts the peaks afresh from the current figures, as torch's does.

Not simulated: kernels. Tensors stay on the CPU, so nothing here runs a model on "cuda" (a whole `train` would move
its model to a device that does not exist); `devkit/fakecuda.py` is the other fake, for the tracer's kernels. The
tests drive a run's samples at the monitor, where a GPU run's figures enter.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

from lowmem_ft.train.measure.allocator import Allocator, Block, Peaks


@dataclass
class _MemoryInfo:
    total: int
    free: int
    used: int


class _NVMLError(Exception):
    pass


@dataclass
class SimulatedGPU:
    """One device: its name, driver, memory, the CUDA context outside the allocator, and the allocator replayed."""

    name: str = "NVIDIA Simulated 24GB"
    driver: str = "570.00"
    total_bytes: int = 24 * 10**9
    context_bytes: int = 500 * 10**6
    allocator: Allocator = field(default_factory=Allocator)

    def __post_init__(self):
        self._window = Peaks()  # the peaks since the last reset_peak_memory_stats

    # -- allocations -------------------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        block = self.allocator.malloc(nbytes)
        self._window.raise_to(self.allocator.current)
        return block

    def free(self, block: Block) -> None:
        self.allocator.free(block)

    def step(self, sample, forward: list[int], backward: list[int], optimizer: list[int], keep: list[Block]) -> None:
        """One training step: the forward keeps `forward` (activations), the backward frees them through transient
        `backward` buffers, the optimizer step allocates `optimizer` (states, kept in `keep` the first time; pass
        [] after). `sample(phase)` is called at each phase's end, as the monitor's hooks are."""
        acts = [self.malloc(n) for n in forward]
        sample("forward")
        for n in backward:
            self.free(self.malloc(n))
        for block in acts:
            self.free(block)
        sample("backward")
        keep.extend(self.malloc(n) for n in optimizer)
        sample("optimizer")

    # -- torch.cuda's answers ----------------------------------------------------------------------------------------
    def memory_allocated(self, device=None) -> int:
        return self.allocator.current.allocated

    def memory_reserved(self, device=None) -> int:
        return self.allocator.current.reserved

    def max_memory_allocated(self, device=None) -> int:
        return self._window.allocated

    def max_memory_reserved(self, device=None) -> int:
        return self._window.reserved

    def reset_peak_memory_stats(self, device=None) -> None:
        self._window = Peaks(**vars(self.allocator.current))

    def mem_get_info(self, device=None) -> tuple[int, int]:
        used = self.context_bytes + self.allocator.current.reserved
        return self.total_bytes - used, self.total_bytes

    # -- NVML's answers ----------------------------------------------------------------------------------------------
    def nvml(self) -> types.ModuleType:
        """A `pynvml` module answering for this device (index 0)."""
        gpu = self
        module = types.ModuleType("pynvml")
        module.NVMLError = _NVMLError
        module.nvmlInit = lambda: None
        module.nvmlShutdown = lambda: None
        module.nvmlDeviceGetCount = lambda: 1
        module.nvmlSystemGetDriverVersion = lambda: gpu.driver
        module.nvmlDeviceGetHandleByIndex = lambda i: gpu if i == 0 else _raise(_NVMLError(f"no device {i}"))
        module.nvmlDeviceGetHandleByUUID = lambda uuid: _raise(_NVMLError(f"no device {uuid}"))
        module.nvmlDeviceGetName = lambda handle: handle.name
        module.nvmlDeviceGetMemoryInfo = _memory_info
        return module

    def install(self, monkeypatch) -> SimulatedGPU:
        """Answer torch.cuda's memory calls and NVML from this device for the rest of the test."""
        import torch

        cuda = torch.cuda
        monkeypatch.setitem(sys.modules, "pynvml", self.nvml())
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
                     "reset_peak_memory_stats", "mem_get_info"):  # fmt: skip
            monkeypatch.setattr(cuda, name, getattr(self, name))
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: 1)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "_get_nvml_device_index", lambda device: 0)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: self.name)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "empty_cache", self.allocator.empty_cache)
        return self


def _raise(exc: Exception):
    raise exc


def _memory_info(gpu: SimulatedGPU) -> _MemoryInfo:
    free, total = gpu.mem_get_info()
    return _MemoryInfo(total, free, total - free)
