"""The start-up moment of a decomposing adapter initialisation (peft's `init_lora_weights`, `adapter.init`).

The one idea: PiSSA and OLoRA build each adapter from a decomposition of the weight it adapts, once, when peft
attaches the adapters (tuners/lora/layer.py `pissa_init`, `olora_init`), and write the residual back into the base
weight. That is a one-off moment before step 1, one adapted linear at a time: the loaded model and the adapters so
far, plus the largest linear's working set (`working_set`). It does not change a training step's peak: `estimate`
gives it as a phase of its own (`phases["start-up"]`) and a start-up component that `plan` shows.

Per adapted linear of out × in features (k = min(out, in), c = bytes of the base weight's dtype), read from peft
0.21 and torch 2.13, and measured on the CPU with `lowmem_ft.train.measure.peak.PeakMemory` (see calibration):
- pissa: `weight.to(float32)` (a copy unless fp32 already), `torch.linalg.svd(full_matrices=False)`'s U (out × k),
  S and Vh (k × in), alive to the end of `pissa_init`; then `weight - scaling·B @ A` holds the out × in product and
  the out × in result at once.
- pissa_niter_N: torch's `svd_lowrank` (torch/_lowrank.py) keeps out × r and in × r factors instead of the full
  SVD's, then the same product and result.
- olora: the fp32 copy, `torch.linalg.qr`'s Q (out × k) and R (k × in), the scaled B (out × r) and the out × in
  product, subtracted in place.
On CUDA the solvers also overwrite a column-major copy of their input (torch's `linalg_svd` / `linalg_qr` clone it
before calling cuSOLVER), which the CPU count cannot see: counted on CUDA, from code, not measured; cuSOLVER's own
workspace is not counted.
"""

from __future__ import annotations

from lowmem_ft.memory.arch import Architecture, Linear
from lowmem_ft.memory.calibration import INIT_PRODUCT_COPIES, INIT_SOLVER_INPUT_COPIES
from lowmem_ft.memory.linears import lora_linears
from lowmem_ft.memory.records import DTYPE_BYTES, Component, Setup

# peft's init_lora_weights values that rewrite the base weights (tuners/lora/model.py subtract_mutated_init)
DECOMPOSING = ("pissa", "olora")


def decomposes(init: str) -> bool:
    """Whether `adapter.init` builds the adapter from a decomposition of the base weight (and rewrites the base)."""
    return init == "olora" or init.startswith("pissa")


def working_set(s: Setup, lin: Linear) -> float:
    """Bytes the decomposition of one adapted linear holds at its peak, beyond the weight and its adapter."""
    o, i, r = lin.out_features, lin.in_features, s.lora_r
    k = min(o, i)
    c = DTYPE_BYTES[s.compute_dtype]
    copy = 0 if c == 4 else 4 * o * i  # weight.to(float32) returns an fp32 weight itself
    # this linear's A and B are still fp32 (peft casts them to the base's dtype after the init; `startup_bytes`)
    copy += (4 - c) * r * (o + i)
    solver = INIT_SOLVER_INPUT_COPIES * 4 * o * i if s.device == "cuda" else 0
    if s.adapter_init == "olora":
        # Q, R, and (scaling·B) @ A: the scaled B (out × r) is alive while the product is made, then subtracted in place
        return copy + 4 * (o * k + k * i) + 4 * o * r + 4 * o * i + solver
    if s.adapter_init == "pissa":
        factors = 4 * (o * k + k + k * i)  # U, S, Vh
    else:  # pissa_niter_N: svd_lowrank's U (out × r), S, V (in × r); no cuSOLVER call of the weight's size
        factors, solver = 4 * (o * r + r + i * r), 0
    return copy + factors + INIT_PRODUCT_COPIES * 4 * o * i + solver


def startup_component(arch: Architecture, s: Setup) -> Component | None:
    """The largest adapted linear's decomposition working set, as a start-up component; None when the adapter is not
    initialised by a decomposition."""
    if s.adapter != "lora" or not decomposes(s.adapter_init):
        return None
    lins = lora_linears(arch, s)
    if not lins:
        return None
    lin = max(lins, key=lambda x: working_set(s, x))
    what = "QR" if s.adapter_init == "olora" else "SVD" if s.adapter_init == "pissa" else "randomized SVD"
    return Component(
        f"{s.adapter_init} init: {what} of {lin.name} (once)",
        working_set(s, lin),
        "start-up",
        "peft lora/layer.py pissa_init / olora_init, torch linalg; measured on the CPU (PeakMemory)",
    )


def startup_bytes(weights: float, lora_params: int, s: Setup, component: Component | None) -> float:
    """Live bytes at the start-up moment: the loaded model (`weights`, every saver not applied yet) and the adapters
    in the base weights' dtype (peft's `_move_adapter_to_device_of_base_layer` after each init; its
    autocast_adapter_dtype makes them fp32 only once all are attached), plus the decomposition's working set (0
    without one). Every adapter is counted: an upper bound by the adapters peft attaches after the largest linear's
    (on the zoo's Phi-3, whose largest linear is not its last: 8 KB of 1.1 MB)."""
    return weights + DTYPE_BYTES[s.compute_dtype] * lora_params + (component.bytes if component else 0.0)
