"""Merging a LoRA adapter into its base: the memory it needs, planned before any weight is read, and an output that
appears whole or not at all.

The plan (`MergePlan`) follows what the libraries do, step by step:
- load: transformers reads the base's safetensors shards memory-mapped (page cache, reclaimable) into tensors of the
  merge dtype on the merge device: the 16-bit base, `params × bytes`; peft loads the adapter beside it (its file's
  size: fp32 as lowmem-ft trains it).
- merge: peft's `merge_and_unload(safe_merge=True)` merges one adapted linear at a time (`LoraLayer.merge`): it clones
  the weight (dtype), computes B·A × scaling in the adapter's fp32 and casts it to the weight's dtype, then replaces
  the weight — out × in × (2 × dtype + 4) bytes for the largest adapted linear, on top of the model.
- save: `save_pretrained` writes shard by shard through safetensors (0.8 `_to_ndarray`): tensors already on the host
  are written in place, tensors on a GPU are copied to the host first and kept until their shard is written — one
  shard (`--max-shard-size`, or the whole model if smaller) of host memory on a GPU merge.

So a GPU merge needs the model + adapter + the largest merge step on the device and one shard on the host; a CPU
merge needs the model + adapter + the largest merge step on the host. `choose` picks the GPU when that fits its free
memory (and the shard fits the host), else the host, and refuses in one line when neither does — before loading.

The output is written into a hidden staging directory beside it (`.NAME.partial-PID`) and renamed to `--output` when
weights, tokenizer and card are all there: a merge killed on the way leaves no directory that looks complete, and
the next merge to that place removes what a dead one left.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lowmem_ft.errors import UserError
from lowmem_ft.memory.inference import human

FP32_BYTES = 4


@dataclass(frozen=True)
class MergePlan:
    """Bytes a merge of `params` parameters in `dtype_bytes` per parameter needs, per step (module docstring)."""

    params: int
    dtype_bytes: int
    adapter: int  # the adapter file's bytes (loaded as saved)
    largest_linear: int  # elements (out × in) of the largest adapted linear
    shard: int  # --max-shard-size in bytes

    @property
    def weights(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def merge_step(self) -> int:
        """The largest adapted linear's merge: a clone of its weight, B·A in fp32, and that cast to the dtype."""
        return self.largest_linear * (2 * self.dtype_bytes + FP32_BYTES)

    @property
    def model(self) -> int:
        """Where the model is merged: weights + adapter + the largest merge step."""
        return self.weights + self.adapter + self.merge_step

    @property
    def save_shard(self) -> int:
        """Host bytes a GPU merge's save holds: one shard of the merged weights (or all of them, if fewer)."""
        return min(self.shard, self.weights)

    def needs(self, device: str) -> tuple[int, int]:
        """(device bytes, host bytes) of a merge on `device`."""
        return (self.model, self.save_shard) if device == "cuda" else (0, self.model)

    def describe(self) -> str:
        return (
            f"{human(self.weights)} weights + {human(self.adapter)} adapter + {human(self.merge_step)} for the largest "
            f"merged linear"
        )


def largest_adapted_linear(model, targets: list[str] | str) -> int:
    """Elements (out × in) of the largest linear whose name the adapter targets, on a model built on the meta device."""
    import torch

    names = [targets] if isinstance(targets, str) else list(targets)
    largest = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith(f".{t}") for t in names):
            largest = max(largest, module.in_features * module.out_features)
    return largest


def available_host_bytes() -> int:
    """Host memory this process may still take (psutil's `available`: free plus reclaimable page cache)."""
    import psutil

    return psutil.virtual_memory().available


def free_device_bytes() -> int:
    import torch

    free, _total = torch.cuda.mem_get_info()
    return free


def choose(plan: MergePlan, requested: str) -> tuple[str, str]:
    """(device, why): the GPU when the merge fits its free memory and its save's shard fits the host, else the host;
    a one-line UserError when the requested device, or every device, is too small."""
    from lowmem_ft.finetuned import resolve_device

    device = resolve_device(requested)
    host = available_host_bytes()
    on_gpu, on_host = plan.needs("cuda"), plan.needs("cpu")
    gpu_free = free_device_bytes() if device == "cuda" else None
    if device == "cuda":
        if gpu_free >= on_gpu[0] and host >= on_gpu[1]:
            return "cuda", f"{human(gpu_free)} free on the GPU"
        if requested == "cuda":
            short = (
                f"the GPU has {human(gpu_free)} free"
                if gpu_free < on_gpu[0]
                else f"the host has {human(host)} "
                f"available for the save's {human(on_gpu[1])} shard (lower --max-shard-size)"
            )
            raise UserError(f"--device cuda: the merge needs {human(on_gpu[0])} on the GPU ({plan.describe()}) "
                            f"but {short}; use --device cpu")  # fmt: skip
    if host >= on_host[1]:
        why = "requested" if requested == "cpu" else "no CUDA GPU"
        if gpu_free is not None:
            why = f"the GPU has {human(gpu_free)} free, the merge needs {human(on_gpu[0])}"
        return "cpu", why
    gpu = f"; the GPU has {human(gpu_free)} free" if gpu_free is not None else ""
    raise UserError(
        f"the merge needs {human(on_host[1])} of host memory ({plan.describe()}) but this machine has "
        f"{human(host)} available{gpu}; free memory, or merge on a machine with more RAM (or a GPU with "
        f"{human(on_gpu[0])} free: --device cuda)"
    )


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clear_dead_staging(output: Path) -> list[Path]:
    """Remove what merges to `output` that died on the way left (`.NAME.partial-PID` of a process no longer alive)."""
    removed = []
    for staged in output.parent.glob(f".{output.name}.partial-*"):
        pid = staged.name.rpartition("-")[2]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(staged, ignore_errors=True)
            removed.append(staged)
    return removed


@contextmanager
def staged_output(output: Path) -> Iterator[Path]:
    """A hidden directory beside `output` to write the merged model into; renamed to `output` (new, or an empty
    directory) when the block completes, removed when it raises."""
    output.parent.mkdir(parents=True, exist_ok=True)
    clear_dead_staging(output)
    staged = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    try:
        yield staged
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    from lowmem_ft.train.resilience.checkpoints import fsync_tree

    fsync_tree(staged)
    if output.is_dir():
        output.rmdir()  # empty (checked before the merge): os.replace cannot rename onto a directory on every system
    os.replace(staged, output)
