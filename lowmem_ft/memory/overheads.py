"""Device overheads beside the live tensors (CUDA only): the context, cuBLAS workspaces and what the caching allocator
reserves over the live tensors, sized in `calibration`.

The allocator's term depends on its setting (`Setup.allocator`): with expandable segments, what `train` sets unless
the user set PYTORCH_CUDA_ALLOC_CONF (`lowmem_ft.cuda_alloc`), a segment grows in place and little is stranded; with
torch's default settings, blocks cached from steps of other sizes are. Each is a base at any size plus a fraction of
what the step allocates and frees, both derived from replays of traced steps (`calibration.ALLOCATOR_*`).
"""

from __future__ import annotations

from lowmem_ft.memory import calibration as cal
from lowmem_ft.memory.calibration import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
from lowmem_ft.memory.records import AllocatorSetting, Component, Setup

# (setting, a full fine-tune) → (bytes at any size, fraction, whether the gradients count in what it is a fraction of)
ALLOCATOR_TERMS: dict[tuple[AllocatorSetting, bool], tuple[int, float, bool]] = {
    ("expandable segments", False): (cal.ALLOCATOR_BASE_EXPANDABLE, cal.ALLOCATOR_FRACTION_EXPANDABLE, True),
    ("expandable segments", True): (cal.ALLOCATOR_BASE_EXPANDABLE_FULL, cal.ALLOCATOR_FRACTION_EXPANDABLE_FULL, True),
    # torch's default settings: the assumed 10 % of the transient peak (calibration says why none was derived)
    ("default", False): (0, cal.ALLOCATOR_FRACTION, False),
    ("default", True): (0, cal.ALLOCATOR_FRACTION, False),
}
ALLOCATOR_PREFIX = "allocator ("  # the allocator component's name: "allocator (expandable segments)"


def allocator_name(setting: AllocatorSetting) -> str:
    return f"{ALLOCATOR_PREFIX}{'default settings' if setting == 'default' else setting})"


def allocator_term(s: Setup) -> tuple[int, float, bool]:
    """(bytes at any size, fraction, whether the gradients count in what it is a fraction of) of the allocator term
    for `s`: its setting, and whether every weight trains (a full fine-tune's gradients and optimizer updates churn
    parameter-sized blocks)."""
    return ALLOCATOR_TERMS[s.allocator, s.adapter == "full"]


def allocator_bytes(s: Setup, transient: float, gradients: float = 0.0) -> float:
    """What the caching allocator reserves over the live tensors of a step whose transient peak is `transient` (see
    `device_overheads`)."""
    base, fraction, with_gradients = allocator_term(s)
    return base + fraction * (transient + (gradients if with_gradients else 0.0))


def device_overheads(s: Setup, transient: float, gradients: float = 0.0) -> list[Component]:
    """The overheads of a step whose transient peak (above the static state) is `transient`; none on the CPU.
    `gradients`: the gradients' bytes, which the allocator sees come and go with every optimizer step (the Trainer
    sets them to None, the next backward allocates them again): what the step allocates and frees is the transient
    peak plus them, as in the replays the fraction was derived from (live peak − the state after step 1)."""
    if s.device != "cuda":
        return []
    base, fraction, with_gradients = allocator_term(s)
    what = "the transient peak and gradients" if with_gradients else "the transient peak"
    how = "replayed traces, benchmarks/allocator_term.md" if base else "assumed"
    return [
        Component("CUDA context", CUDA_CONTEXT_BYTES, "overhead", "assumed (see CUDA_CONTEXT_BYTES)"),
        Component("cuBLAS workspaces", CUBLAS_WORKSPACE_BYTES, "overhead", "torch CublasHandlePool"),
        Component(
            allocator_name(s.allocator),
            allocator_bytes(s, transient, gradients),
            "overhead",
            f"{base / 2**20:.0f} MiB + {fraction:.1%} of {what} ({how})"
            if base
            else f"{fraction:.0%} of {what} ({how})",
        ),
    ]


def transient_without_overheads(s: Setup, with_overheads: float) -> float:
    """The transient peak whose `device_overheads` bring it to `with_overheads` (the inverse; as is on the CPU)."""
    if s.device != "cuda":
        return with_overheads
    base, fraction, _ = allocator_term(s)
    return (with_overheads - CUDA_CONTEXT_BYTES - CUBLAS_WORKSPACE_BYTES - base) / (1 + fraction)


def allocator_growth(s: Setup) -> float:
    """How much the device's peak grows per byte of transient: 1 plus the allocator's fraction (1 on the CPU)."""
    return 1 + (allocator_term(s)[1] if s.device == "cuda" else 0.0)


def allocator_component_bytes(components: list[Component]) -> float:
    """The allocator term among an estimate's components (0.0 without one)."""
    return sum(c.bytes for c in components if c.name.startswith(ALLOCATOR_PREFIX))


def overhead_bytes(components: list[Component]) -> float:
    """The overheads' sum, in the order they were added (0.0 when there are none)."""
    total = 0.0
    for c in components:
        total += c.bytes
    return total
