"""Device overheads beside the live tensors (CUDA only): the context, cuBLAS workspaces and what the caching allocator
reserves over the live tensors, sized in `calibration`.

The allocator's term depends on its setting (`Setup.allocator`) and is derived from replays of traced steps
(`calibration.ALLOCATOR_*`, benchmarks/allocator_term.md), in the form the replays' excess takes: with expandable
segments (what `train` sets unless the user set PYTORCH_CUDA_ALLOC_CONF, `lowmem_ft.cuda_alloc`) a segment grows in
place, and what is left is a share of what an adapter step allocates and frees, or, in a full fine-tune of tied
embeddings, two free blocks of the embedding gradient's size (`allocator_block`), or, in an adapter step with the
full-logits loss, a hole of the logits' size its backward cannot fill. With torch's default settings the
excess is freed blocks stranded when the step's largest tensor (`loss.largest_step_block`) asks for a segment, but
their number is no constant: the term stays an assumed share of the transient (`calibration` gives the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_ft.memory import calibration as cal
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
from lowmem_ft.memory.loss import largest_step_block, loss_block
from lowmem_ft.memory.records import DTYPE_BYTES, AllocatorSetting, Component, Setup


@dataclass(frozen=True)
class AllocatorTerm:
    """base + fraction × (the transient peak, plus the gradients when `with_gradients`) + blocks × the block size
    (`allocator_block`)."""

    base: int  # bytes at any size
    fraction: float
    with_gradients: bool  # the gradients count in what it is a fraction of (every optimizer step frees them)
    blocks: float = 0.0  # how many blocks of `allocator_block`'s size


ALLOCATOR_TERMS: dict[tuple[AllocatorSetting, bool], AllocatorTerm] = {
    ("expandable segments", False): AllocatorTerm(
        cal.ALLOCATOR_BASE_EXPANDABLE, cal.ALLOCATOR_FRACTION_EXPANDABLE, True
    ),
    # a full fine-tune: 2.02 × the tied embedding's gradient (`allocator_block`; none when untied) + a base + a share
    ("expandable segments", True): AllocatorTerm(
        cal.ALLOCATOR_BASE_EXPANDABLE_FULL,
        cal.ALLOCATOR_FRACTION_EXPANDABLE_FULL,
        True,
        cal.ALLOCATOR_TIED_GRAD_BLOCKS_EXPANDABLE,
    ),
    # torch's default settings: the assumed 10 % of the transient peak (calibration says why no block form is taken)
    ("default", False): AllocatorTerm(0, cal.ALLOCATOR_FRACTION, False),
    ("default", True): AllocatorTerm(0, cal.ALLOCATOR_FRACTION, False),
}
# Expandable segments, an adapter step with the full-logits loss (`loss_impl` "hf_full"): blocks of its fp32 logits
# (`allocator_block`) and a base, derived from such steps alone, and at least the other adapter steps' term, whose
# share of the churn those steps do not reach but a step of more churn beside its logits might (`allocator_terms`);
# a full fine-tune keeps its own term (calibration says why)
ALLOCATOR_TERM_FULL_LOGITS = AllocatorTerm(
    cal.ALLOCATOR_BASE_EXPANDABLE_LOGITS, 0.0, True, cal.ALLOCATOR_LOGIT_BLOCKS_EXPANDABLE
)
ALLOCATOR_PREFIX = "allocator ("  # the allocator component's name: "allocator (expandable segments)"


def allocator_name(setting: AllocatorSetting) -> str:
    return f"{ALLOCATOR_PREFIX}{'default settings' if setting == 'default' else setting})"


def allocator_terms(s: Setup) -> tuple[AllocatorTerm, ...]:
    """The terms whose largest allowance is the allocator's for `s`: the term of its setting and of whether every
    weight trains (a full fine-tune's gradients and optimizer updates churn parameter-sized blocks); for an adapter
    step with the full-logits loss under expandable segments (`full_logits_hole`) its own term, then the other
    adapter steps' term. On every replayed step with that loss the first is the larger, but none of them churns
    more than 11 times its fp32 logits, and the share the second takes of the churn is what the other adapter steps
    left at most (benchmarks/allocator_term.md)."""
    if full_logits_hole(s):
        return ALLOCATOR_TERM_FULL_LOGITS, ALLOCATOR_TERMS[s.allocator, False]
    return (ALLOCATOR_TERMS[s.allocator, s.adapter == "full"],)


def full_logits_hole(s: Setup) -> bool:
    """Expandable segments and an adapter step with the full-logits loss: its c-byte logits, freed when the loss's
    forward returns, leave a hole between the saved activations that its backward's fp32 gradients, twice their
    size, cannot fill, so the segment grows past it (the replays, benchmarks/allocator_term.md). Not ORPO / SimPO,
    whose trainer keeps the logits (`preference.method_estimate` prices them with the other adapters' term)."""
    return s.allocator == "expandable segments" and s.adapter != "full" and s.loss_impl == "hf_full"


def allocator_block(arch: Architecture, s: Setup, training: bool = True) -> float:
    """The size of the blocks the allocator's term counts for `s`: with torch's default settings the step's largest
    tensor (`largest_step_block`; a no-grad pass's, `training` False: its loss path's forward); with expandable
    segments the embedding's gradient in a full fine-tune of tied embeddings (else none) — in an evaluation pass
    too: the training steps left those blocks cached, and reserved bytes count them until `empty_cache`; and an
    adapter training step's fp32 logits with the full-logits loss (`full_logits_hole`)."""
    if s.allocator == "default":
        return largest_step_block(arch, s) if training else loss_block(arch, s, backward=False)
    if full_logits_hole(s):
        # a no-grad pass frees no logits under a backward: replayed after the training steps, an evaluation forward
        # reserved 80 MiB over its live peak (Qwen2.5-0.5B LoRA, 8 × 512) where its fp32 logits are 2.3 GB
        return loss_block(arch, s) if training else 0.0
    tied_grad = s.adapter == "full" and arch.tie_embeddings
    return float(DTYPE_BYTES[s.compute_dtype] * arch.vocab_size * arch.hidden_size) if tied_grad else 0.0


def allocator_bytes(s: Setup, transient: float, gradients: float = 0.0, *, block: float) -> float:
    """What the caching allocator reserves over the live tensors of a step whose transient peak is `transient`
    and whose counted blocks are `block` bytes each (`allocator_block`; see `device_overheads`)."""
    return max(
        t.base + t.blocks * block + t.fraction * (transient + (gradients if t.with_gradients else 0.0))
        for t in allocator_terms(s)
    )


def _reasons(s: Setup, block: float) -> str:
    """`_reason` of each of `allocator_terms(s)`: the larger of them where there are two."""
    parts = [_reason(t, block) for t in allocator_terms(s)]
    if len(parts) == 1:
        return parts[0]
    end = " (replayed traces, benchmarks/allocator_term.md)"
    return "the larger of " + " and ".join(p.removesuffix(end) for p in parts) + end


def _reason(t: AllocatorTerm, block: float) -> str:
    what = "the transient peak and gradients" if t.with_gradients else "the transient peak"
    if not (t.base or t.blocks):  # torch's default settings: no derived form holds (`calibration.ALLOCATOR_FRACTION`)
        return f"{t.fraction:.0%} of {what} (assumed)"
    parts = [f"{t.base / 2**20:.0f} MiB"]
    if t.blocks and block:
        parts.append(f"{t.blocks:g} × the {block / 1e9:.2f} GB block")
    if t.fraction:
        parts.append(f"{t.fraction:.1%} of {what}")
    return " + ".join(parts) + " (replayed traces, benchmarks/allocator_term.md)"


def device_overheads(s: Setup, transient: float, gradients: float = 0.0, *, block: float) -> list[Component]:
    """The overheads of a step whose transient peak (above the static state) is `transient`; none on the CPU.
    `gradients`: the gradients' bytes, which the allocator sees come and go with every optimizer step (the Trainer
    sets them to None, the next backward allocates them again): what the step allocates and frees is the transient
    peak plus them, as in the replays the fraction was derived from (live peak − the state after step 1). `block`:
    `allocator_block` of the step."""
    if s.device != "cuda":
        return []
    return [
        Component("CUDA context", CUDA_CONTEXT_BYTES, "overhead", "assumed (see CUDA_CONTEXT_BYTES)"),
        Component("cuBLAS workspaces", CUBLAS_WORKSPACE_BYTES, "overhead", "torch CublasHandlePool"),
        Component(
            allocator_name(s.allocator),
            allocator_bytes(s, transient, gradients, block=block),
            "overhead",
            _reasons(s, block),
        ),
    ]


def transient_without_overheads(s: Setup, with_overheads: float, *, block: float) -> float:
    """The transient peak whose `device_overheads` (with the same `block`) bring it to `with_overheads` (the
    inverse; as is on the CPU)."""
    if s.device != "cuda":
        return with_overheads
    # each term solved alone; the allowance is the larger term, so the transient is the smaller solution
    return min(
        (with_overheads - CUDA_CONTEXT_BYTES - CUBLAS_WORKSPACE_BYTES - t.base - t.blocks * block) / (1 + t.fraction)
        for t in allocator_terms(s)
    )


def allocator_growth(s: Setup) -> float:
    """How much the device's peak grows per byte of transient: 1 plus the allocator's fraction, the larger one where
    two terms apply (1 on the CPU)."""
    return 1 + (max(t.fraction for t in allocator_terms(s)) if s.device == "cuda" else 0.0)


def allocator_component_bytes(components: list[Component]) -> float:
    """The allocator term among an estimate's components (0.0 without one)."""
    return sum(c.bytes for c in components if c.name.startswith(ALLOCATOR_PREFIX))


def overhead_bytes(components: list[Component]) -> float:
    """The overheads' sum, in the order they were added (0.0 when there are none)."""
    total = 0.0
    for c in components:
        total += c.bytes
    return total
