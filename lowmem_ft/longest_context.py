"""The planner's longest trainable context for a model at a VRAM target, from the tier recipe: what
`python -m devkit.bench.max_context` tabulates and the GPU check runs. Beside `lowmem_ft.choosing`, whose request it
builds, because it is a question asked of the planner, not a step of choosing a run's recipe."""

from __future__ import annotations

from typing import Any

from lowmem_ft.choosing import fixed_knobs, request_for, target_for, tier_for_vram
from lowmem_ft.memory.lengths import round_seq_len
from lowmem_ft.memory.long_context import KNOBS as LONG_CONTEXT_KNOBS
from lowmem_ft.memory.planner import Request, max_seq_len
from lowmem_ft.recipe.load import merge, resolve

# What `longest_context(savers=...)` lets the planner choose: "all" (everything it may turn on), "previous" (activation
# offloading and the chunked loss at its automatic 64 MiB chunks: the planner before the long-context savers),
# "none" (neither). The knobs left out are fixed at the tier recipe's values (off).
SAVER_SETS = {
    "all": frozenset(),
    "previous": LONG_CONTEXT_KNOBS,
    "none": LONG_CONTEXT_KNOBS | {"activation_offloading", "loss_impl"},
}


def context_request(
    model: str, vram_gb: float, overrides: dict | None = None, savers: str = "all"
) -> tuple[Any, Request]:
    """(architecture, request) of `longest_context`: the tier recipe for `vram_gb` with `overrides` fixed and the
    savers outside `SAVER_SETS[savers]` fixed off."""
    from lowmem_ft.memory.arch import load_architecture

    fixed = merge(overrides or {}, {"model": {"name_or_path": model}})
    start = resolve(tier_for_vram(vram_gb), fixed)
    request = request_for(start, target_for(vram_gb, start), fixed=fixed_knobs(fixed) | SAVER_SETS[savers])
    return load_architecture(model, start.model.trust_remote_code), request


def longest_context(model: str, vram_gb: float, overrides: dict | None = None, *, savers: str = "all",
                    limit: int = 262144, positions: bool = True) -> int:  # fmt: skip
    """The planner's longest trainable `max_seq_len` for `model` at `vram_gb`, starting from the tier recipe with
    `overrides` fixed (e.g. NF4 LoRA at batch 1); 0 when nothing fits. `savers` says which savers the planner may
    turn on (`SAVER_SETS`); `positions` caps the length at the model's positions as `plan` and `train` do (False:
    what memory allows). What `python -m devkit.bench.max_context` tabulates and the GPU check runs."""
    arch, request = context_request(model, vram_gb, overrides, savers)
    if positions and arch.max_position_embeddings:
        limit = min(limit, round_seq_len(arch.max_position_embeddings, up=False))
    return max_seq_len(arch, request, limit=limit)
