"""Device overheads beside the live tensors (CUDA only): the context, cuBLAS workspaces and the caching allocator's
rounding, sized in `calibration` (assumed there, not measured: no GPU measured them yet)."""

from __future__ import annotations

from lowmem_ft.memory.calibration import ALLOCATOR_FRACTION, CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
from lowmem_ft.memory.records import Component, Setup


def device_overheads(s: Setup, transient: float) -> list[Component]:
    """The overheads of a step whose transient peak (above the static state) is `transient`; none on the CPU."""
    if s.device != "cuda":
        return []
    return [
        Component("CUDA context", CUDA_CONTEXT_BYTES, "overhead", "assumed (see CUDA_CONTEXT_BYTES)"),
        Component("cuBLAS workspaces", CUBLAS_WORKSPACE_BYTES, "overhead", "torch CublasHandlePool"),
        Component(
            "allocator rounding/fragmentation", ALLOCATOR_FRACTION * transient, "overhead", "10% of transient peak"
        ),
    ]


def overhead_bytes(components: list[Component]) -> float:
    """The overheads' sum, in the order they were added (0.0 when there are none)."""
    total = 0.0
    for c in components:
        total += c.bytes
    return total
