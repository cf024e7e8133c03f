"""The device a training process runs on, set up before anything touches CUDA: allocator, GPU, `--vram` cap.

Order matters, and this module is where it is kept. `PYTORCH_CUDA_ALLOC_CONF` is read when the caching allocator
initialises, so it is set first. Under `train --gpus N` each rank must make its own GPU (torchrun's `LOCAL_RANK`)
current before the first CUDA call: anything that touches CUDA before (a memory cap, a device query) opens a
context on GPU 0, and N ranks would all cap and crowd GPU 0. The cap then applies to the rank's own GPU.
"""

from __future__ import annotations

import gc
import logging
import os

from lowmem_ft.cuda_alloc import ALLOC_CONF, DEFAULT_ALLOC_CONF, user_alloc_conf

log = logging.getLogger(__name__)

GB = 1e9  # decimal, like lowmem_ft.memory.estimate.GB and --vram


def configure_allocator() -> str | None:
    """Set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` unless the user set it (or `PYTORCH_ALLOC_CONF`);
    returns what is in effect. The decision is `lowmem_ft.cuda_alloc`'s, which `plan` prices too."""
    import torch

    user = user_alloc_conf()
    if user is not None:
        return user
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning("CUDA was initialised before lowmem-ft could set %s=%s", ALLOC_CONF, DEFAULT_ALLOC_CONF)
        return None
    os.environ[ALLOC_CONF] = DEFAULT_ALLOC_CONF
    return DEFAULT_ALLOC_CONF


def local_device() -> int | None:
    """Make this process's GPU current — `LOCAL_RANK` under torchrun, else 0 — and return its index (None without
    CUDA). Call it before any other CUDA call of the process."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return index


def cap_process_memory(vram_gb: float | None) -> float | None:
    """Cap this process's CUDA allocator at `vram_gb` GB on its own GPU when the card is bigger; returns the VRAM the
    run has (the target, else the card's total; without CUDA the target, or None).

    `torch.cuda.set_per_process_memory_fraction` makes the caching allocator raise OutOfMemoryError once reserved
    memory would pass the fraction — the same error a card of that size would give, so a 24 GB plan is honoured (and
    tested) on an 80 GB card.
    """
    import torch

    device = local_device()  # first: the cap and the device query below must not open a context on GPU 0
    if device is None:
        return vram_gb
    total = torch.cuda.get_device_properties(device).total_memory
    if vram_gb is None:
        return total / GB
    if vram_gb * GB < total:
        torch.cuda.set_per_process_memory_fraction(vram_gb * GB / total, device)
        log.info("capped CUDA memory of this process at %.1f of the card's %.1f GB (--vram)", vram_gb, total / GB)
        return vram_gb
    return total / GB


def free_memory() -> None:
    """Return a failed step's memory: drop Python references (the traceback is gone by now) and cached blocks."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
